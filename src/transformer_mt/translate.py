"""stdin -> stdout translation: `make translate CKPT=<checkpoint> < in.en > out.de`."""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from transformer_mt.module import load_for_inference
from transformer_mt.search import translate_lines

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


def pick_device(name: str) -> torch.device:
    return torch.device("cuda" if name == "auto" and torch.cuda.is_available() else "cpu" if name == "auto" else name)


def stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@hydra.main(config_path=CONF_DIR, config_name="translate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    model, tokenizer, _ = load_for_inference(cfg.ckpt)
    model.to(pick_device(cfg.device))
    decoding = OmegaConf.to_container(cfg.decoding)
    # Lines end with "\n" only: U+0085 and friends inside a line are text, not line breaks.
    stdin = open(sys.stdin.fileno(), encoding="utf-8", errors="strict", newline="\n", closefd=False)
    lines_done, start = 0, time.perf_counter()
    while chunk := [line.rstrip("\n") for line in itertools.islice(stdin, cfg.batch_lines)]:
        warn = lambda message: stderr(f"warning: input {message}")  # noqa: E731
        for text in translate_lines(model, tokenizer, chunk, warn=warn, first_line=lines_done + 1, **decoding):
            sys.stdout.write(text + "\n")
        sys.stdout.flush()
        lines_done += len(chunk)
    seconds = time.perf_counter() - start
    stderr(f"translated {lines_done} lines in {seconds:.1f} s ({lines_done / max(seconds, 1e-9):.1f} sentences/s, "
           f"beam {decoding['beam_size']})")


if __name__ == "__main__":
    main()
