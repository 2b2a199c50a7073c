"""The decoder behind make translate / evaluate / tune (`engine=`): ours (search.py), or CTranslate2 in a process of
its own without torch (ct2_worker.py; two OpenMP runtimes in one process slow both) from an export beside the
checkpoint, <name>.ct2/, made again when the checkpoint's bytes change."""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from transformer_mt.decoding import PAPER, Heartbeat
from transformer_mt.errors import WRITE_FAULTS, InputError, UserError, required
from transformer_mt.files import atomic_write, file_digest

SOURCE_FILE = "checkpoint.json"  # in the export folder, written last: which checkpoint bytes it was made from


def ct2_folder(ckpt: Path) -> Path:
    return ckpt.with_name(ckpt.name.removesuffix(".ckpt") + ".ct2")


def ct2_export(ckpt: str | Path, log: Callable[[str], None] = print) -> Path:
    """The CTranslate2 (float32) export of `ckpt`, beside it: made now if missing or made from other bytes."""
    from transformer_mt.checkpoint import read_checkpoint  # noqa: PLC0415 (torch: only when exporting)
    from transformer_mt.tools.export import export  # noqa: PLC0415

    ckpt = Path(ckpt)
    max_positions = read_checkpoint(ckpt, mmap=True, finite=False)["hyper_parameters"]["model"]["max_positions"]
    folder, digest = ct2_folder(ckpt), file_digest(ckpt)
    try:
        if json.loads((folder / SOURCE_FILE).read_text(encoding="utf-8"))["sha256"] == digest:
            return folder
    except (OSError, ValueError, KeyError, TypeError):
        pass  # missing, or an export cut short
    if folder.exists():
        log(
            f"engine=ct2: {folder} is not an export of {ckpt} as it is now (it changed, or an export was cut short): "
            "exporting again"
        )
        shutil.rmtree(folder)
    else:
        log(f"engine=ct2: exporting {ckpt} for CTranslate2 into {folder} (once; again when the checkpoint changes)")
    try:
        with contextlib.redirect_stdout(sys.stderr):  # make translate's stdout is the translation
            export(str(ckpt), "ct2", str(folder))
    except OSError as e:
        if e.errno not in WRITE_FAULTS:
            raise
        raise InputError(
            f"engine=ct2 exports beside the checkpoint, and {folder.parent} cannot be written ({e.strerror}): copy the "
            f"checkpoint to a writable folder, or export it yourself (make export FORMAT=ct2 OUT=<folder>)"
        ) from None
    info = {"checkpoint": str(ckpt), "sha256": digest, "max_source_tokens": max_positions - 1}
    with atomic_write(folder / SOURCE_FILE) as tmp:
        tmp.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return folder


class CT2Process(contextlib.AbstractContextManager):
    """CTranslate2 in a child process (ct2_worker.py), fed and answered in JSON lines. A context manager."""

    CHUNK = 500  # lines per request when a progress bar is shown

    def __init__(self, folder: Path, device: str = "auto", threads: int = 0, compute_type: str = "float32"):
        from transformer_mt.runtime import usable_cores  # noqa: PLC0415

        self.limit = json.loads((folder / SOURCE_FILE).read_text(encoding="utf-8"))["max_source_tokens"]
        command = [sys.executable, "-m", "transformer_mt.evaluation.ct2_worker"]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, encoding="utf-8")
        threads = threads or usable_cores()
        ready = self.ask(dict(model=str(folder), device=device, threads=threads, compute_type=compute_type))
        self.device, self.torch_imported = ready["device"], ready["torch_imported"]

    def ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request, ensure_ascii=False) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise UserError(f"the CTranslate2 process ended (exit status {self.process.wait()}); its stderr is above")
        answer = json.loads(line)
        if "error" in answer:
            raise UserError(f"CTranslate2: {answer['error']}")
        return answer

    def translate_lines(
        self,
        lines: list[str],
        warn=None,
        first_line: int = 1,
        tokens_per_batch: int = 16384,
        n_best: int = 0,
        progress: bool = False,
        report=None,
        **decoding,
    ) -> list[str]:
        """search.translate_lines' contract (text in, text out, same order; decoding: Decoding's settings, the
        paper's where left out), decoded by CTranslate2."""
        from tqdm import tqdm  # noqa: PLC0415

        if n_best:
            raise InputError("n_best needs engine=torch: engine=ct2 gives the best translation only")
        settings = PAPER.but(**decoding)
        request = dict(
            beam_size=settings.beam_size,
            length_penalty=settings.ct2_length_penalty,  # gnmt 0.6: 0.45
            max_len_a=settings.max_len_a,
            max_len_b=settings.max_len_b,
            max_source_tokens=self.limit,
            tokens_per_batch=tokens_per_batch,
        )
        size, heartbeat = self.CHUNK if progress or report else max(len(lines), 1), Heartbeat(report, len(lines))
        outputs = []
        bar = tqdm(total=len(lines), desc="translating", unit="sentence", disable=not progress, leave=False)
        for at in range(0, len(lines), size):
            chunk = lines[at : at + size]
            answer = self.ask(request | {"lines": chunk})
            for i, tokens in answer["truncated"] if warn else []:
                warn(f"line {first_line + at + i}: {tokens} tokens, truncated to the model's maximum of {self.limit}")
            outputs += answer["outputs"]
            bar.update(len(chunk))
            heartbeat(len(outputs))
        bar.close()
        return outputs

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait()


@contextlib.contextmanager
def open_engine(cfg) -> Iterator[tuple[Callable[..., list], dict]]:
    """For conf/inference.yaml's keys: (search.translate_lines less its model and tokenizer, the training config)."""
    from transformer_mt.checkpoint import read_checkpoint, start_inference  # noqa: PLC0415 (torch)

    ckpt = required(cfg, "ckpt")
    if cfg.engine not in ("torch", "ct2"):
        raise InputError(f"engine={cfg.engine}: choose torch (ours) or ct2 (CTranslate2)")
    if cfg.engine == "torch":
        from transformer_mt.runtime import compile_decoding  # noqa: PLC0415
        from transformer_mt.search import translate_lines  # noqa: PLC0415

        model, tokenizer, checkpoint = start_inference(ckpt, cfg.device, cfg.threads)
        if cfg.compile:
            compile_decoding(model)
        yield functools.partial(translate_lines, model, tokenizer), checkpoint["hyper_parameters"].get("config", {})
        return
    if cfg.compile:
        raise InputError("compile=true compiles our decoder (engine=torch); engine=ct2 is compiled already")
    folder = ct2_export(ckpt, log=lambda message: print(message, file=sys.stderr, flush=True))
    config = read_checkpoint(ckpt, mmap=True, finite=False)["hyper_parameters"].get("config", {})
    with CT2Process(folder, cfg.device, cfg.threads, cfg.ct2_compute_type) as process:
        yield process.translate_lines, config
