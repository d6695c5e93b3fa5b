"""Random views of a whole batch at once (plain torch tensor operations, on the training device).

The per-sample MONAI pipelines of :func:`fedpartial.data.transforms.augment_transforms` cost milliseconds per
sample on a CPU core, one sample at a time (``benchmarks/local_round_speed.py`` measures both); here the same augmentations are
drawn per sample but applied to the ``(B, C, S, S)`` batch in a few vectorised operations (``affine_grid`` /
``grid_sample`` for the geometry, grouped convolutions for the filters), so they also run on a GPU.

Same kinds, same parameter ranges as the MONAI pipelines: both read :data:`fedpartial.data.views.VIEWS` (each
draw independent per sample).

The random numbers come from a ``torch.Generator`` the caller seeds (the site seed, round and epoch), so a seed
reproduces the views; they are not the numbers MONAI's pipelines draw (``train.views: per_sample`` keeps those).
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Collection, Mapping, Sequence

import torch
import torch.nn.functional as F

from .views import AffineRanges, ViewParams, view_params


def _uniform(n: int, lo: float, hi: float, gen: torch.Generator) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(n, generator=gen, dtype=torch.float64)


def sample_affine(n: int, ranges: AffineRanges, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Per-sample affine parameters: ``angle`` (rad), ``shift`` ``(n, 2)`` as fractions of the side (x, y),
    ``scale`` ``(n, 2)``; samples not drawn (probability ``ranges.prob``) get the identity."""
    on = torch.rand(n, generator=gen, dtype=torch.float64) < ranges.prob
    r = math.radians(ranges.rotate_deg)
    angle = _uniform(n, -r, r, gen) * on
    shift = torch.stack([_uniform(n, -ranges.translate, ranges.translate, gen) for _ in range(2)], 1) * on[:, None]
    scale = 1 + torch.stack([_uniform(n, -ranges.scale, ranges.scale, gen) for _ in range(2)], 1) * on[:, None]
    return {"angle": angle, "shift": shift, "scale": scale}


def affine_theta(angle: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(n, 2, 3)`` matrices for :func:`torch.nn.functional.affine_grid` (``align_corners=False``) equal to MONAI's
    ``Affine(rotate_params=angle, translate_params=(ty, tx) px, scale_params=(sy, sx))``: the affine maps output
    to input coordinates about the image centre, ``input = R (S output + t)`` with MONAI's rotation (by
    ``-angle`` in (x, y) order); ``shift`` ``(n, 2)`` = (tx, ty) in fractions of the side."""
    cos, sin = torch.cos(angle), torch.sin(angle)
    rot = torch.stack([torch.stack([cos, sin], 1), torch.stack([-sin, cos], 1)], 1)  # (n, 2, 2), (x, y) order
    a = rot * scale[:, None, :]  # R @ diag(sx, sy)
    offset = (rot @ (2 * shift).unsqueeze(-1)).squeeze(-1)  # R t, t in normalised units (the side = 2)
    return torch.cat([a, offset.unsqueeze(-1)], 2)


def warp(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """``(B, C, S, S)`` -> same shape, bilinear, zeros outside the image."""
    grid = F.affine_grid(theta.to(x.device, x.dtype, non_blocking=True), list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def flip(x: torch.Tensor, which: torch.Tensor, dim: int) -> torch.Tensor:
    """Flip the samples where ``which`` ``(B,)`` is True along ``dim`` (3 = horizontal, 2 = vertical)."""
    return torch.where(which.view(-1, 1, 1, 1).to(x.device, non_blocking=True), x.flip(dim), x)


# Compare-exchange pairs of a 19-step sorting network whose slot 4 ends up holding the median of 9 values (the
# classic "median of 9" network, Paeth 1990 / Devillard): slot a gets the minimum, slot b the maximum.
_MEDIAN9 = (
    (1, 2),
    (4, 5),
    (7, 8),
    (0, 1),
    (3, 4),
    (6, 7),
    (1, 2),
    (4, 5),
    (7, 8),
    (0, 3),
    (5, 8),
    (4, 7),
    (3, 6),
    (1, 4),
    (2, 5),
    (4, 7),
    (4, 2),
    (6, 4),
    (4, 2),
)


def median3(x: torch.Tensor) -> torch.Tensor:
    """3x3 median filter (edges replicated, as MONAI's ``MedianSmooth(radius=1)``): ``(B, C, H, W)``.

    Element-wise minima / maxima over the 9 shifted views (:data:`_MEDIAN9`) instead of sorting unfolded patches:
    the same values (ties included; ``tests/test_batch_views.py``), without a sort."""
    h, w = x.shape[-2:]
    padded = F.pad(x, (1, 1, 1, 1), mode="replicate")
    v = [padded[..., i : i + h, j : j + w] for i in range(3) for j in range(3)]
    for a, b in _MEDIAN9:
        v[a], v[b] = torch.minimum(v[a], v[b]), torch.maximum(v[a], v[b])
    return v[4].contiguous()


def gaussian_blur(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Separable Gaussian blur with a per-sample ``sigma`` ``(B, 2)`` (x = width, y = height), as MONAI's
    ``GaussianSmooth``: kernels from differences of ``erf`` over each pixel, truncated at 4 sigma, not
    renormalised, zero padding. ``(B, C, H, W)`` -> same shape."""
    b, c, h, w = x.shape
    sigma = sigma.to(torch.float32).clamp_min(1e-3)
    tails = (torch.clamp(4.0 * sigma, min=0.5) + 0.5).floor()  # (B, 2) per-sample kernel half-widths
    radius = int(tails.max()) if b else 0  # read where sigma lives (the host): no wait on the device
    sigma, tails = sigma.to(x.device, non_blocking=True), tails.to(x.device, non_blocking=True)
    pos = torch.arange(-radius, radius + 1, dtype=torch.float32, device=x.device)
    out = x.reshape(1, b * c, h, w)
    for axis in (0, 1):  # x (width) then y (height)
        t = 0.70710678 / sigma[:, axis : axis + 1]
        k = (0.5 * (torch.erf(t * (pos + 0.5)) - torch.erf(t * (pos - 0.5)))).clamp_min(0)
        k = torch.where(pos.abs()[None] <= tails[:, axis : axis + 1], k, torch.zeros_like(k)).to(x.dtype)
        k = k.repeat_interleave(c, 0)  # (B*C, K)
        weight = k.view(b * c, 1, 1, -1) if axis == 0 else k.view(b * c, 1, -1, 1)
        pad = (radius, radius, 0, 0) if axis == 0 else (0, 0, radius, radius)
        out = F.conv2d(F.pad(out, pad), weight, groups=b * c)
    return out.view(b, c, h, w)


def gaussian_noise(shape: Sequence[int], seed: int, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """Standard normal noise of ``shape`` drawn on ``device`` itself (a generator of that device seeded with
    ``seed``): no host-side draw and copy of a full batch (32 x 3 x 224^2 floats) on a GPU."""
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed))
    return torch.randn(tuple(shape), generator=gen, device=device, dtype=dtype)


def adjust_contrast(x: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    """Per-sample gamma on the image's own min-max range (MONAI ``AdjustContrast``): ``(B, C, H, W)``."""
    flat = x.flatten(1)
    lo, hi = flat.min(1).values.view(-1, 1, 1, 1), flat.max(1).values.view(-1, 1, 1, 1)
    rng = hi - lo
    g = gamma.to(x.device, x.dtype, non_blocking=True).view(-1, 1, 1, 1)
    return ((x - lo) / (rng + 1e-7)).clamp_min(0) ** g * rng + lo


class BatchAugment:
    """Random views of ``(B, C, S, S)`` batches in [0, 1] (see the module docstring), then normalisation.

    Args:
        mean, std: per-channel normalisation (None: none).
        channels: the model's input channels: a stored 1-channel batch is repeated to as many (:func:`as_float`).
    """

    def __init__(
        self, mean: Sequence[float] | None = None, std: Sequence[float] | None = None, channels: int | None = None
    ):
        self.channels = None if channels is None else int(channels)  # the model's input channels (as_float)
        self.mean = None if mean is None else torch.tensor([float(m) for m in mean])
        self.std = None if std is None else torch.tensor([float(s) for s in std])
        if self.mean is None and self.std is not None:
            self.mean = torch.zeros_like(self.std)
        if self.std is None and self.mean is not None:
            self.std = torch.ones_like(self.mean)

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        if self.mean is None:
            return x
        m, s = self.mean.to(x.device, x.dtype, non_blocking=True), self.std.to(x.device, x.dtype, non_blocking=True)
        return (x - m.view(1, -1, 1, 1)) / s.view(1, -1, 1, 1)

    def __call__(self, x: torch.Tensor, kind: str, gen: torch.Generator) -> torch.Tensor:
        """``(B, C, S, S)`` float in [0, 1] -> one view per sample, same shape, normalised, in ``x``'s dtype.

        Drawn with autocast off (a round under ``train.amp`` draws the same float32 views as one without)."""
        p = view_params(kind)
        with torch.autocast(x.device.type, enabled=False):
            return self._view(x, p, gen)

    def draw(self, n: int, kind: str, gen: torch.Generator) -> dict:
        """The random parameters of ``n`` views of ``kind``: the numbers :meth:`__call__` draws from ``gen`` for a
        batch of ``n``, in the same order, without the image work. A view that is not needed is skipped this way
        and the views drawn after it from ``gen`` stay what they were."""
        return self._draw(n, view_params(kind), gen)

    @staticmethod
    def _draw(n: int, p: ViewParams, gen: torch.Generator) -> dict:
        d: dict = {}
        if p.vflip:
            d["vflip"] = torch.rand(n, generator=gen) < p.vflip
        if p.hflip:
            d["hflip"] = torch.rand(n, generator=gen) < p.hflip
        if p.affine is not None:
            d["affine"] = sample_affine(n, p.affine, gen)
        if p.p_filter:
            d["filter"] = _draw_filter(n, p, gen)
        if p.p_intensity:
            d["intensity"] = _draw_intensity(n, p, gen)
        return d

    def _view(self, x: torch.Tensor, p: ViewParams, gen: torch.Generator) -> torch.Tensor:
        d = self._draw(x.shape[0], p, gen)
        if p.vflip:
            x = flip(x, d["vflip"], 2)
        if p.hflip:
            x = flip(x, d["hflip"], 3)
        if p.affine is not None:
            x = warp(x, affine_theta(**d["affine"]))
        if p.p_filter:
            x = _apply_filter(x, p, *d["filter"])
        if p.p_intensity:
            x = _apply_intensity(x, p, *d["intensity"])
        if p.clipped:
            x = x.clamp(0.0, 1.0)
        return self.normalise(x)

    @staticmethod
    def _filter(x: torch.Tensor, p: ViewParams, gen: torch.Generator) -> torch.Tensor:
        """One of {3x3 median, Gaussian blur, Gaussian noise, nothing} per sample."""
        return _apply_filter(x, p, *_draw_filter(x.shape[0], p, gen))

    @staticmethod
    def _intensity(x: torch.Tensor, p: ViewParams, gen: torch.Generator) -> torch.Tensor:
        """Brightness then contrast, together, per sample with probability ``p.p_intensity``."""
        return _apply_intensity(x, p, *_draw_intensity(x.shape[0], p, gen))


def _draw_filter(n: int, p: ViewParams, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(choice (n,) in {0: median, 1: blur, 2: noise, 3: nothing}, blur sigma (n, 2), noise seed)``."""
    choice = torch.multinomial(
        torch.tensor([p.p_filter / 3] * 3 + [1 - p.p_filter]), n, replacement=True, generator=gen
    )
    sigma = torch.stack([_uniform(n, *p.blur_sigma, gen) for _ in range(2)], 1)
    return choice, sigma, int(torch.randint(0, 2**62, (1,), generator=gen))


def _apply_filter(x: torch.Tensor, p: ViewParams, choice: torch.Tensor, sigma: torch.Tensor, noise_seed: int):
    out = x.clone()
    median, blur, noisy = (choice == k for k in range(3))  # host masks: indices, not device masks (no wait)
    if median.any():
        rows = _rows(median, x.device)
        out[rows] = median3(x[rows])
    if blur.any():
        rows = _rows(blur, x.device)
        out[rows] = gaussian_blur(x[rows], sigma[blur])
    if noisy.any():
        rows = _rows(noisy, x.device)
        picked = x[rows]
        out[rows] = picked + gaussian_noise(picked.shape, noise_seed, x.device, x.dtype) * p.noise_std
    return out


def _draw_intensity(n: int, p: ViewParams, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(on (n,) bool, brightness factor (n,), contrast gamma (n,))``."""
    on = torch.rand(n, generator=gen) < p.p_intensity
    factor = 1 + _uniform(n, -p.brightness, p.brightness, gen)
    return on, factor, _uniform(n, *p.gamma, gen)


def _apply_intensity(x: torch.Tensor, p: ViewParams, on: torch.Tensor, factor: torch.Tensor, gamma: torch.Tensor):
    if not on.any():
        return x
    rows = _rows(on, x.device)
    out = x.clone()
    y = x[rows] * factor[on].to(x.device, x.dtype, non_blocking=True).view(-1, 1, 1, 1)
    out[rows] = adjust_contrast(y, gamma[on])
    return out


def _rows(mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The positions where a host ``(B,)`` bool mask is True, as an index tensor on ``device`` (indexing a device
    tensor with a device mask would make the host wait for the device to count the rows)."""
    return mask.nonzero().squeeze(1).to(device, non_blocking=True)


def as_float(src: torch.Tensor, channels: int | None = None) -> torch.Tensor:
    """A batch of stored images ``(B, c, S, S)`` (uint8 from the image store, or float in [0, 1]) -> float32 in
    [0, 1] with ``channels`` channels (a 1-channel batch repeated), on the batch's own device: the conversion
    runs where the batch already is (the training device), never on the host first."""
    x = src.float().div_(255.0) if src.dtype == torch.uint8 else src
    if channels is not None and x.shape[1] != channels:
        if x.shape[1] != 1:
            raise ValueError(f"a {x.shape[1]}-channel batch cannot feed a {channels}-channel model")
        x = x.expand(-1, channels, -1, -1).contiguous()
    return x


def draw_views(
    batch: dict,
    views: Mapping[str, str],
    augment: BatchAugment,
    gen: torch.Generator,
    device: torch.device | str = "cpu",
    pin_memory: bool = False,
    keys: Collection[str] | None = None,
) -> dict:
    """Replace a collated batch's ``"source"`` ``(B, c, S, S)`` (uint8 from the image store, or float in [0, 1]) by
    the requested views (key -> kind) on ``device``: the batch crosses to ``device`` as it is stored (uint8, its own
    channels) and is converted there (:func:`as_float`); the other entries are moved to ``device`` too.

    ``keys``: make only these of the views (None: all); the others' random numbers are drawn all the same
    (:meth:`BatchAugment.draw`), so every view drawn from ``gen`` afterwards is the one it would have been."""
    device = torch.device(device)
    src = batch.pop("source")
    if pin_memory and device.type == "cuda":
        src = src.pin_memory()
    src = as_float(src.to(device, non_blocking=True), augment.channels)
    out = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
    for key, kind in views.items():
        if keys is None or key in keys:
            out[key] = augment(src, kind, gen)
        else:
            augment.draw(src.shape[0], kind, gen)
    return out


def prefetched(loader, depth: int, pin_memory: bool):
    """Iterate ``loader`` in a background thread, ``depth`` batches ahead (collated and, with ``pin_memory``, pinned
    there), so the next batch is ready while the device trains on this one. Same batches, same order; an error
    in the thread is raised here; leaving the loop early stops the thread."""
    q: queue.Queue = queue.Queue(maxsize=max(1, int(depth)))
    stop = threading.Event()
    done = object()

    def work():
        try:
            for batch in loader:
                if pin_memory:
                    batch = {k: v.pin_memory() if torch.is_tensor(v) else v for k, v in batch.items()}
                while not stop.is_set():
                    try:
                        q.put(batch, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(done)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put(e)

    thread = threading.Thread(target=work, name="fedpartial-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                thread.join(0.05)


PREFETCH_ON_GPU = 2  # batches a ViewLoader on a GPU prepares ahead by default (0: none, in the main thread)


class ViewLoader:
    """A loader whose batches carry the cached images under ``"source"``, turned into the requested views by
    :func:`draw_views`; the generator is seeded once per loader from ``seed``, so the same seed gives the same
    views (and the wrapped loader the same order).

    ``prefetch``: batches collated (and pinned, ``pin_memory``) ahead in a background thread (:func:`prefetched`);
    the host-to-device copy is then asynchronous and the views are drawn on the device. None: 2 on a GPU, 0 (off)
    on a CPU, where there is nothing to overlap with. The batches and views are the same either way.

    ``resident`` (with ``order``, a loader of index batches in the wrapped loader's order): the site's images,
    labels, mask and indices already on the device (:meth:`~fedpartial.data.sitedata.SiteDatasets.resident`);
    each batch is gathered there, nothing crosses from the host but the indices."""

    def __init__(
        self,
        loader,
        views: Mapping[str, str],
        augment: BatchAugment,
        seed: int,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
        prefetch: int | None = None,
        order=None,
        resident: dict | None = None,
    ):
        self.loader, self.views, self.augment, self.seed = loader, dict(views), augment, int(seed)
        self.order, self.resident = order, resident
        self.device, self.pin_memory = torch.device(device), pin_memory
        self.prefetch = (
            int(prefetch) if prefetch is not None else (PREFETCH_ON_GPU if self.device.type == "cuda" else 0)
        )
        self.dataset = loader.dataset

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        gen = torch.Generator()
        gen.manual_seed(self.seed)
        if self.resident is not None:  # the images already on the device: gather each batch there
            for indices in self.order:
                yield draw_views(gather(self.resident, indices), self.views, self.augment, gen, self.device)
            return
        pin = self.pin_memory and self.device.type == "cuda"
        batches = prefetched(self.loader, self.prefetch, pin) if self.prefetch > 0 else self.loader
        for batch in batches:
            yield draw_views(batch, self.views, self.augment, gen, self.device, pin and self.prefetch <= 0)


class IndexDataset(torch.utils.data.Dataset):
    """Items ``0 .. n-1`` themselves: a loader over it gives the index batches (and order) a loader with the same
    arguments gives over any dataset of ``n`` items."""

    def __init__(self, n: int):
        self.n = int(n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def gather(data: dict[str, torch.Tensor], indices) -> dict[str, torch.Tensor]:
    """The rows ``indices`` (host ints / ``(B,)`` tensor) of every tensor of a resident split
    (:meth:`~fedpartial.data.sitedata.SiteDatasets.resident`), as a batch like the loader's (``source``, ``label``,
    ``mask``, ``index``), on the tensors' device."""
    device = data["index"].device
    idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1).to(device, non_blocking=True)
    return {k: v.index_select(0, idx) for k, v in data.items()}
