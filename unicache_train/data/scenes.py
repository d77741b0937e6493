"""Bundled synthetic vision-language data: scenes of coloured shapes, three task types.

Every sample is a pure function of ``(seed, index)`` (numpy ``default_rng([seed, index])``), so
train and evaluation sets are reproducible and never overlap when their seeds differ; nothing is
downloaded.

A scene is a ``grid x grid`` board of cells, one cell per vision patch (48 x 48 pixels, 8 x 8
patches: 6 x 6 cells). The background is one dull, uniform colour over most of the board plus
a textured band (stripes or a checker pattern) covering one to two rows or columns; a few
saturated shapes (circle, square, triangle, cross) sit in distinct cells. Most patches are
therefore near-duplicates of their neighbours (uniform background), some are busy but carry
nothing the questions ask about (texture), and a handful hold all the answers: the situation
the UniCache article describes for real images (§1, §2.2).

Task types (``TASKS``), all with answers that begin with a fixed lead-in, so the informative
answer tokens are decoded *after* the prompt, from the (compressed) cache: the first answer token
is predicted by the last prompt position, which in both the prefill of inference and the in-loop
forward still attends to the uncompressed context:

* ``describe``: "describe the image." -> "a red circle and a blue square." (one to
  ``max_describe`` shapes in reading order: rows top to bottom, left to right);
* ``count``: "how many shapes?" / "how many red shapes?" / "how many circles?" ->
  "there are 3." / "there is 1.";
* ``refer``: "what colour is the shape left of the red circle?" -> "it is blue."; "what shape
  is above the green cross?" -> "it is a square.". The referred shape is the only shape on the
  reference's row (column) on that side, and the reference is the only shape of its colour and
  kind, so the answer is unique and depends on one region of the image.

Several images per sample (``images_per_sample > 1``): the prompt reads "image 1: <img> image 2:
<img> ... in image k, <question>"; the question is about one of them.

Prompts mark each image with the placeholder ``IMAGE_MARK``; the multimodal data module expands
it into ``patches_per_image`` vision positions (see :mod:`unicache_train.data.multimodal`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from unicache_train.validation import ConfigError
from unicache_train.validation import check_int as _int
from unicache_train.validation import check_range as _range

__all__ = [
    "SceneConfig",
    "Shape",
    "Scene",
    "TASKS",
    "COLOURS",
    "KINDS",
    "IMAGE_MARK",
    "render_scene",
    "random_scene",
    "make_sample",
    "scene_samples",
    "scene_words",
    "cell_labels",
    "NUM_CELL_CLASSES",
]

#: Placeholder of one image inside a prompt.
IMAGE_MARK = "<image>"
TASKS: tuple[str, ...] = ("describe", "count", "refer")
#: Shape colours (name -> RGB in [0, 1]): saturated, far from the background palette.
COLOURS: dict[str, tuple[float, float, float]] = {
    "red": (0.90, 0.10, 0.10),
    "green": (0.10, 0.80, 0.15),
    "blue": (0.10, 0.25, 0.95),
    "yellow": (0.95, 0.90, 0.10),
    "purple": (0.65, 0.15, 0.85),
}
KINDS: tuple[str, ...] = ("circle", "square", "triangle", "cross")
#: Dull background colours and texture colours.
_BACKGROUNDS = ((0.55, 0.55, 0.55), (0.62, 0.58, 0.50), (0.40, 0.42, 0.45), (0.50, 0.56, 0.52))
_TEXTURES = ((0.30, 0.30, 0.30), (0.75, 0.72, 0.66), (0.45, 0.38, 0.33))
_RELATIONS = {"left of": (0, -1), "right of": (0, 1), "above": (-1, 0), "below": (1, 0)}


@dataclass
class SceneConfig:
    """The synthetic scene task.

    Attributes:
        seed: seed of the training samples (evaluation uses its own seed).
        num_train: training samples per epoch (generated on the fly, deterministic by index).
        num_val: validation samples (drawn with ``seed + 1``).
        image_size: pixels per side; ``image_size / cell_size`` cells per side.
        cell_size: pixels per cell (equal to the vision patch size: one shape per patch).
        min_shapes, max_shapes: shapes per image (refer and count draw in this range, and so
            do the other images of a multi-image sample).
        max_describe: a ``describe`` image holds 1 to ``max_describe`` shapes (its answer
            lists them all, so this keeps it short).
        images_per_sample: ``[min, max]`` images per sample.
        tasks: task types to draw from (uniformly).
        noise: std of the Gaussian pixel noise (keeps background patches near, not exactly,
            identical).
    """

    seed: int = 7
    num_train: int = 50_000
    num_val: int = 600
    image_size: int = 48
    cell_size: int = 8
    min_shapes: int = 2
    max_shapes: int = 4
    max_describe: int = 3
    images_per_sample: list[int] = field(default_factory=lambda: [1, 1])
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    noise: float = 0.02

    def __post_init__(self) -> None:
        _int(self, "seed", 0)
        _int(self, "num_train", 1)
        _int(self, "num_val", 0)
        _int(self, "cell_size", 4, 64)
        _int(self, "image_size", 2 * self.cell_size, 1024)
        if self.image_size % self.cell_size:
            raise ConfigError(
                f"SceneConfig.image_size={self.image_size} is not a multiple of "
                f"cell_size={self.cell_size}"
            )
        grid = self.image_size // self.cell_size
        _int(self, "min_shapes", 2, grid * grid)
        _int(self, "max_shapes", self.min_shapes, min(grid * grid, 9))
        _int(self, "max_describe", 1, self.max_shapes)
        ips = self.images_per_sample
        if (
            not isinstance(ips, (list, tuple))
            or len(ips) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) for v in ips)
            or not 1 <= ips[0] <= ips[1] <= 8
        ):
            raise ConfigError(
                f"SceneConfig.images_per_sample={ips!r}: expected [min, max] with "
                "1 <= min <= max <= 8"
            )
        self.images_per_sample = list(ips)
        if not isinstance(self.tasks, (list, tuple)) or not self.tasks:
            raise ConfigError(f"SceneConfig.tasks={self.tasks!r}: expected a non-empty list")
        bad = [t for t in self.tasks if t not in TASKS]
        if bad:
            raise ConfigError(
                f"SceneConfig.tasks={self.tasks!r}: {bad} not allowed; choose from {list(TASKS)}"
            )
        self.tasks = list(self.tasks)
        _range(self, "noise", 0.0, 0.5)

    @property
    def grid(self) -> int:
        return self.image_size // self.cell_size


@dataclass(frozen=True)
class Shape:
    colour: str
    kind: str
    row: int
    col: int

    @property
    def name(self) -> str:
        return f"{self.colour} {self.kind}"


@dataclass
class Scene:
    """One image's content: shapes plus the background description."""

    shapes: list[Shape]
    background: int
    texture: int
    band: tuple[str, int, int]  # ("row" | "col", first index, width in cells)
    pattern: str  # "stripes" | "checker"


# ----------------------------------------------------------------------------- rendering
def _shape_mask(kind: str, size: int) -> np.ndarray:
    """[size, size] bool mask of a shape filling most of its cell."""
    c = (size - 1) / 2.0
    y, x = np.mgrid[0:size, 0:size].astype(np.float64)
    r = size / 2.0 - 0.5
    if kind == "circle":
        return (x - c) ** 2 + (y - c) ** 2 <= r * r + 0.5
    if kind == "square":
        m = np.zeros((size, size), bool)
        m[1:-1, 1:-1] = True
        return m
    if kind == "triangle":  # apex up
        half = (y + 1) / size * (size / 2.0)
        return np.abs(x - c) <= half
    if kind == "cross":
        w = max(1, size // 4)
        lo, hi = int(round(c - w / 2.0 + 0.01)), int(round(c + w / 2.0 + 0.01)) + 1
        m = np.zeros((size, size), bool)
        m[lo:hi, :] = True
        m[:, lo:hi] = True
        return m
    raise ValueError(f"unknown shape kind {kind!r}; known: {list(KINDS)}")


def render_scene(scene: Scene, cfg: SceneConfig, rng: np.random.Generator) -> np.ndarray:
    """Pixels of a scene: float32 [3, H, W] in [0, 1]."""
    S, c = cfg.image_size, cfg.cell_size
    img = np.empty((S, S, 3), np.float32)
    img[:] = _BACKGROUNDS[scene.background]
    axis, start, width = scene.band
    yy, xx = np.mgrid[0:S, 0:S]
    if scene.pattern == "stripes":
        pat = ((xx + yy) // 2) % 2 == 0
    else:
        pat = ((xx // 2) + (yy // 2)) % 2 == 0
    lo, hi = start * c, (start + width) * c
    band = (yy >= lo) & (yy < hi) if axis == "row" else (xx >= lo) & (xx < hi)
    img[band & pat] = _TEXTURES[scene.texture]
    size = c - 2  # a shape leaves a one-pixel margin in its cell
    for sh in scene.shapes:
        mask = _shape_mask(sh.kind, size)
        y0, x0 = sh.row * c + 1, sh.col * c + 1
        img[y0 : y0 + size, x0 : x0 + size][mask] = COLOURS[sh.colour]
    if cfg.noise > 0:
        img += rng.normal(0.0, cfg.noise, img.shape).astype(np.float32)
    return np.clip(img, 0.0, 1.0).transpose(2, 0, 1).copy()


# ----------------------------------------------------------------------------- scenes and tasks
def _random_background(cfg: SceneConfig, rng: np.random.Generator) -> dict[str, Any]:
    width = int(rng.integers(1, 3))
    return dict(
        background=int(rng.integers(len(_BACKGROUNDS))),
        texture=int(rng.integers(len(_TEXTURES))),
        band=(
            ("row", "col")[int(rng.integers(2))],
            int(rng.integers(0, cfg.grid - width + 1)),
            width,
        ),
        pattern=("stripes", "checker")[int(rng.integers(2))],
    )


def _random_shape(rng: np.random.Generator, row: int, col: int) -> Shape:
    colour = list(COLOURS)[int(rng.integers(len(COLOURS)))]
    return Shape(colour, KINDS[int(rng.integers(len(KINDS)))], row, col)


def random_scene(cfg: SceneConfig, rng: np.random.Generator, n_shapes: int) -> Scene:
    """Shapes in distinct random cells; (colour, kind) pairs unique within the scene."""
    g = cfg.grid
    cells = rng.permutation(g * g)[:n_shapes]
    shapes: list[Shape] = []
    for cell in cells:
        while True:
            sh = _random_shape(rng, int(cell) // g, int(cell) % g)
            if all(sh.name != o.name for o in shapes):
                break
        shapes.append(sh)
    return Scene(shapes=shapes, **_random_background(cfg, rng))


def _refer_scene(
    cfg: SceneConfig, rng: np.random.Generator, n_shapes: int
) -> tuple[Scene, Shape, Shape, str]:
    """A scene with a reference shape and the unique shape on one side of it."""
    g = cfg.grid
    while True:
        rel = list(_RELATIONS)[int(rng.integers(len(_RELATIONS)))]
        dr, dc = _RELATIONS[rel]
        r0, c0 = int(rng.integers(g)), int(rng.integers(g))
        steps = [k for k in range(1, g) if 0 <= r0 + dr * k < g and 0 <= c0 + dc * k < g]
        if steps:
            break
    k = steps[int(rng.integers(len(steps)))]
    ref = _random_shape(rng, r0, c0)
    while True:
        tgt = _random_shape(rng, r0 + dr * k, c0 + dc * k)
        if tgt.name != ref.name:
            break
    # Other shapes stay off the reference's ray in that direction (the answer stays unique).
    ray = {(r0 + dr * j, c0 + dc * j) for j in range(1, g)}
    free = [(r, c) for r in range(g) for c in range(g) if (r, c) not in ray and (r, c) != (r0, c0)]
    shapes = [ref, tgt]
    for i in rng.permutation(len(free))[: n_shapes - 2]:
        r, c = free[int(i)]
        while True:
            sh = _random_shape(rng, r, c)
            if all(sh.name != o.name for o in shapes):
                break
        shapes.append(sh)
    order = rng.permutation(len(shapes))  # the draw order must not reveal which is which
    scene = Scene(shapes=[shapes[int(i)] for i in order], **_random_background(cfg, rng))
    return scene, ref, tgt, rel


#: Classes of :func:`cell_labels`: 0 background (plain or textured), then colour x kind.
NUM_CELL_CLASSES = 1 + len(COLOURS) * len(KINDS)


def cell_labels(scene: Scene, cfg: SceneConfig) -> np.ndarray:
    """int64 [grid * grid], row-major: 0 for background, ``1 + colour * len(KINDS) + kind`` for
    the cell holding a shape (supervision for pretraining a vision tower, as real VLMs start
    from a pretrained encoder)."""
    out = np.zeros(cfg.grid * cfg.grid, dtype=np.int64)
    colours = list(COLOURS)
    for sh in scene.shapes:
        out[sh.row * cfg.grid + sh.col] = (
            1 + colours.index(sh.colour) * len(KINDS) + KINDS.index(sh.kind)
        )
    return out


def _article(kind: str) -> str:
    return f"a {kind}"


def _describe(scene: Scene) -> str:
    names = [f"a {s.name}" for s in sorted(scene.shapes, key=lambda s: (s.row, s.col))]
    body = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return f"{body}."


def _count_answer(n: int) -> str:
    return "there is 1." if n == 1 else f"there are {n}."


def make_sample(cfg: SceneConfig, seed: int, index: int, task: str | None = None) -> dict:
    """Sample ``index`` of the stream seeded by ``seed``.

    Returns:
        dict with ``images`` (list of float32 [3, H, W]), ``prompt`` (text with one
        :data:`IMAGE_MARK` per image, ending with the question and a space), ``answer``,
        ``task``, ``target_image`` (index of the image the question is about) and
        ``cell_labels`` (per image, :func:`cell_labels`: what each cell holds).
    """
    rng = np.random.default_rng([seed, index])
    if task is None:
        task = cfg.tasks[int(rng.integers(len(cfg.tasks)))]
    elif task not in TASKS:
        raise ValueError(f"task={task!r} is not a task type; choose from {list(TASKS)}")
    lo, hi = cfg.images_per_sample
    n_img = int(rng.integers(lo, hi + 1))
    target = int(rng.integers(n_img))
    scenes: list[Scene] = []
    question = answer = ""
    for i in range(n_img):
        lo_shapes, hi_shapes = cfg.min_shapes, cfg.max_shapes
        if i == target and task == "describe":
            lo_shapes, hi_shapes = 1, cfg.max_describe
        n_shapes = int(rng.integers(lo_shapes, hi_shapes + 1))
        if i == target and task == "refer":
            scene, ref, tgt, rel = _refer_scene(cfg, rng, n_shapes)
            if rng.random() < 0.5:
                question = f"what colour is the shape {rel} the {ref.name}?"
                answer = f"it is {tgt.colour}."
            else:
                question = f"what shape is {rel} the {ref.name}?"
                answer = f"it is {_article(tgt.kind)}."
        else:
            scene = random_scene(cfg, rng, n_shapes)
        scenes.append(scene)
    shapes = scenes[target].shapes
    if task == "describe":
        question, answer = "describe the image.", _describe(scenes[target])
    elif task == "count":
        kind = int(rng.integers(3))
        pick = shapes[int(rng.integers(len(shapes)))]
        if kind == 0:
            question, n = "how many shapes?", len(shapes)
        elif kind == 1:
            question = f"how many {pick.colour} shapes?"
            n = sum(s.colour == pick.colour for s in shapes)
        else:
            question = f"how many {pick.kind}s?"
            n = sum(s.kind == pick.kind for s in shapes)
        answer = _count_answer(n)
    images = [render_scene(s, cfg, rng) for s in scenes]
    labels = [cell_labels(s, cfg) for s in scenes]
    if n_img == 1:
        prompt = f"{IMAGE_MARK}{question} "
    else:
        marks = " ".join(f"image {i + 1}: {IMAGE_MARK}" for i in range(n_img))
        prompt = f"{marks} in image {target + 1}, {question} "
    return {
        "images": images,
        "prompt": prompt,
        "answer": answer,
        "task": task,
        "target_image": target,
        "cell_labels": labels,
    }


def scene_words() -> list[str]:
    """Every word and mark the scene prompts and answers use (the vocabulary of
    ``MultimodalDataConfig.tokenizer = "words"``)."""
    words = set(COLOURS) | set(KINDS) | {f"{k}s" for k in KINDS}
    words |= {w for rel in _RELATIONS for w in rel.split()}
    words |= set(
        "what colour is the shape how many shapes describe image in there are it a and".split()
    )
    words |= {str(i) for i in range(10)} | set(".,?:")
    return sorted(words)


def scene_samples(
    cfg: SceneConfig, n: int, seed: int, tasks: list[str] | None = None
) -> list[dict]:
    """``n`` samples; with ``tasks`` they cycle through the given task types (balanced)."""
    if tasks:
        return [make_sample(cfg, seed, i, tasks[i % len(tasks)]) for i in range(n)]
    return [make_sample(cfg, seed, i) for i in range(n)]
