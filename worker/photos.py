"""The sample photos the project ships nothing for and downloads nothing for: scikit-image's bundled public-domain
photos (the `models` extra). The demo's clips, `worker check-model`'s scores and int8 calibration all read them
here, so a runtime module never reaches up into worker.tools for them."""

from __future__ import annotations

import numpy as np

# Photos in scikit-image's data package (no download): an astronaut, coffee, a cat, a rocket, a camera man.
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera")


def photo(name: str) -> np.ndarray:
    """A scikit-image photo as (height, width, 3) uint8 RGB (grey ones are repeated to RGB)."""
    import skimage.data

    img = np.asarray(getattr(skimage.data, name)())
    return np.repeat(img[:, :, None], 3, axis=2) if img.ndim == 2 else img[:, :, :3]
