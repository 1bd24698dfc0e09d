"""Loading a model in each supported form, and the start-up contract check that rejects unusable ones."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # makes "model_factories:<fn>" importable, as PYTHONPATH would

import model_factories

from worker.config import ConfigError, ModelSettings, load_settings
from worker.runtime import ModelContractError, build_builtin_model, load_model
from worker.runtime.models import ModelContract

LABELS = ModelSettings().labels
# TorchScript is deprecated upstream but still a supported model.source form here.
pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.* is deprecated:FutureWarning")


def _settings(**kw) -> ModelSettings:
    return ModelSettings(**kw)


def _sample(batch: int = 3, h: int = 48, w: int = 40) -> torch.Tensor:
    return torch.randn(batch, 3, h, w, generator=torch.Generator().manual_seed(7))


# --- builtin ---

def test_builtin_model_is_the_default_and_outputs_one_score_per_label():
    loaded = load_model(ModelSettings())
    assert loaded.kind == "builtin"
    with torch.inference_mode():
        assert loaded.module(_sample()).shape == (3, len(LABELS))


def test_builtin_weights_are_deterministic_and_leave_the_global_rng_alone():
    torch.manual_seed(99)
    before = torch.get_rng_state()
    a, b = build_builtin_model(5), build_builtin_model(5)
    assert torch.equal(torch.get_rng_state(), before)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name


def test_builtin_model_takes_any_height_and_width():
    model = build_builtin_model(5)
    with torch.inference_mode():
        for h, w in [(1, 1), (17, 300), (224, 224), (480, 640)]:
            assert model(torch.zeros(1, 3, h, w)).shape == (1, 5)


def test_builtin_model_has_as_many_outputs_as_configured_labels():
    loaded = load_model(_settings(labels=("a", "b")))
    with torch.inference_mode():
        assert loaded.module(_sample()).shape == (3, 2)


def test_zero_padding_rows_of_a_batch_do_not_change_the_real_rows():
    """What bucket padding relies on: in eval mode each row of the batch is computed independently."""
    model = build_builtin_model(5)
    x = _sample(3)
    with torch.inference_mode():
        alone = model(x)
        padded = model(torch.cat([x, torch.zeros(5, *x.shape[1:])]))[:3]
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-6)


# --- user models ---

def test_torchscript_file_loads_and_matches_the_original(tmp_path):
    original = build_builtin_model(5)
    path = tmp_path / "model.pt"
    torch.jit.script(original).save(str(path))
    loaded = load_model(_settings(source=str(path)))
    assert loaded.kind == "torchscript"
    with torch.inference_mode():
        torch.testing.assert_close(loaded.module(_sample()), original(_sample()))


def test_torch_export_file_loads_and_takes_other_batch_sizes_and_shapes(tmp_path):
    original = build_builtin_model(5)
    dyn = torch.export.Dim.DYNAMIC
    program = torch.export.export(original, (_sample(2),), dynamic_shapes=({0: dyn, 2: dyn, 3: dyn},))
    path = tmp_path / "model.pt2"
    torch.export.save(program, str(path))
    loaded = load_model(_settings(source=str(path)))
    assert loaded.kind == "export"
    with torch.inference_mode():
        x = _sample(4, 64, 80)
        torch.testing.assert_close(loaded.module(x), original(x))


def test_factory_module_function_loads():
    loaded = load_model(_settings(source="model_factories:tiny_model"))
    assert loaded.kind == "factory"
    assert isinstance(loaded.module, model_factories.TinyNet)


def test_factory_with_state_dict_file_gets_those_weights(tmp_path):
    trained = model_factories.TinyNet()
    with torch.no_grad():
        for p in trained.parameters():
            p.fill_(0.125)
    path = tmp_path / "weights.pt"
    torch.save(trained.state_dict(), path)
    loaded = load_model(_settings(source="model_factories:tiny_model", state_dict=str(path)))
    for name, value in loaded.module.state_dict().items():
        assert torch.equal(value, trained.state_dict()[name]), name


# --- contract violations: each names the problem ---

def test_missing_model_file_is_a_contract_error(tmp_path):
    with pytest.raises(ModelContractError, match="no such file"):
        load_model(_settings(source=str(tmp_path / "absent.pt")))


def test_corrupt_torchscript_file_is_a_contract_error(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"definitely not a zip archive")
    with pytest.raises(ModelContractError, match="not a loadable TorchScript file"):
        load_model(_settings(source=str(path)))


def test_corrupt_export_file_is_a_contract_error(tmp_path):
    path = tmp_path / "model.pt2"
    path.write_bytes(b"garbage")
    with pytest.raises(ModelContractError, match="not a loadable torch.export program"):
        load_model(_settings(source=str(path)))


def test_unimportable_factory_module_is_a_contract_error():
    with pytest.raises(ModelContractError, match="cannot import module 'no_such_package.models'"):
        load_model(_settings(source="no_such_package.models:build"))


def test_factory_function_missing_from_module_is_a_contract_error():
    with pytest.raises(ModelContractError, match="has no attribute 'no_such_function'"):
        load_model(_settings(source="model_factories:no_such_function"))


def test_factory_that_raises_is_a_contract_error():
    with pytest.raises(ModelContractError, match="weights server unreachable"):
        load_model(_settings(source="model_factories:failing_factory"))


def test_factory_returning_a_non_module_is_a_contract_error():
    with pytest.raises(ModelContractError, match="expected a torch.nn.Module"):
        load_model(_settings(source="model_factories:not_a_module"))


def test_output_with_wrong_number_of_labels_is_a_contract_error():
    with pytest.raises(ModelContractError, match=r"output has shape \[2, 3\].*expected \[2, 5\]"):
        load_model(_settings(source="model_factories:wrong_output_model"))


def test_output_that_is_not_one_tensor_is_a_contract_error():
    with pytest.raises(ModelContractError, match="returned tuple"):
        load_model(_settings(source="model_factories:tuple_output_model"))


class _FixedSize(torch.nn.Module):
    """Takes 8x8 inputs only, like a model exported without dynamic height and width."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], 3 * 8 * 8)[:, :5]


class _NeedsContiguousNCHW(torch.nn.Module):
    """Flattens with view(): needs contiguous NCHW memory, which the Normaliser does not hand over."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], -1)[:, :5]


def test_a_model_that_needs_contiguous_nchw_memory_fails_at_load_naming_channels_last(tmp_path):
    path = tmp_path / "view.pt"
    torch.jit.script(_NeedsContiguousNCHW()).save(str(path))
    with pytest.raises(ModelContractError, match="channels_last memory"):
        load_model(_settings(source=str(path), input_size=(8, 8)))


def test_model_failing_on_the_dummy_input_suggests_input_size(tmp_path):
    path = tmp_path / "fixed.pt"
    torch.jit.script(_FixedSize()).save(str(path))
    with pytest.raises(ModelContractError, match="set model.input_size"):
        load_model(_settings(source=str(path)))
    assert load_model(_settings(source=str(path), input_size=(8, 8))).kind == "torchscript"


def test_state_dict_of_another_architecture_is_a_contract_error(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save(build_builtin_model(5).state_dict(), path)
    with pytest.raises(ModelContractError, match="does not fit the model"):
        load_model(_settings(source="model_factories:tiny_model", state_dict=str(path)))


def test_state_dict_that_is_not_a_tensor_file_is_a_contract_error(tmp_path):
    path = tmp_path / "weights.pt"
    path.write_bytes(b"nope")
    with pytest.raises(ModelContractError, match="torch.load"):
        load_model(_settings(source="model_factories:tiny_model", state_dict=str(path)))


def test_mean_and_std_must_describe_rgb_or_grayscale():
    # Validated once, by the config, before the runtime sees the contract.
    with pytest.raises(ConfigError, match="model.mean: has 2 values"):
        load_settings(env={"WORKER_MODEL_MEAN": "0.5,0.5", "WORKER_MODEL_STD": "0.5,0.5"})


# --- contract: thresholds -> verdict ---

def test_verdict_flags_labels_at_or_above_their_threshold():
    contract = ModelContract.from_settings(
        _settings(labels=("a", "b", "c"), thresholds={"a": 0.9}, default_threshold=0.5))
    verdict = contract.verdict([0.8, 0.5, 0.49])
    assert verdict.scores == pytest.approx({"a": 0.8, "b": 0.5, "c": 0.49})
    assert verdict.flagged_labels == ("b",)


# --- layering ---

def test_runtime_imports_neither_kafka_nor_the_pipeline_stages():
    forbidden = ("confluent_kafka", "worker.loop.pipeline", "worker.kafka", "worker.batching")
    runtime_dir = Path(__file__).resolve().parents[2] / "worker" / "runtime"
    for path in runtime_dir.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith(forbidden), f"{path.name} imports {name}"
