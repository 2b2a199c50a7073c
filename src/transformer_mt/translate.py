"""stdin -> stdout translation: `make translate CKPT=<checkpoint> < in.en > out.de`."""

from __future__ import annotations

import itertools
import sys
import time

import hydra
from omegaconf import DictConfig, OmegaConf

from transformer_mt.checkpoint import load_for_inference, pick_device
from transformer_mt.config import CONF_DIR
from transformer_mt.files import exit_on_user_error, required
from transformer_mt.search import translate_lines


def stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def warn_about_input(message: str) -> None:
    stderr(f"warning: input {message}")


def translate(cfg: DictConfig) -> None:
    model, tokenizer, _ = load_for_inference(required(cfg, "ckpt"))
    model.to(pick_device(cfg.device))
    decoding = OmegaConf.to_container(cfg.decoding)
    # Lines end with "\n" only: U+0085 and friends inside a line are text, not line breaks.
    stdin = open(sys.stdin.fileno(), encoding="utf-8", errors="strict", newline="\n", closefd=False)  # noqa: SIM115 (stdin stays open)
    lines_done, start = 0, time.perf_counter()
    while chunk := [line.rstrip("\n") for line in itertools.islice(stdin, cfg.batch_lines)]:
        texts = translate_lines(
            model,
            tokenizer,
            chunk,
            warn=warn_about_input,
            first_line=lines_done + 1,
            progress=sys.stderr.isatty(),
            **decoding,
        )
        for text in texts:
            sys.stdout.write(text + "\n")
        sys.stdout.flush()
        lines_done += len(chunk)
    seconds = time.perf_counter() - start
    stderr(
        f"translated {lines_done} lines in {seconds:.1f} s ({lines_done / max(seconds, 1e-9):.1f} sentences/s, "
        f"beam {decoding['beam_size']})"
    )


@hydra.main(config_path=CONF_DIR, config_name="translate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    exit_on_user_error(translate, cfg)


if __name__ == "__main__":
    main()
