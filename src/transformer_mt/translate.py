"""stdin -> stdout translation: `make translate CKPT=<checkpoint> < in.en > out.de`."""

from __future__ import annotations

import itertools
import sys
import time

from omegaconf import DictConfig

from transformer_mt.commandline import chosen_decoding, hydra_command
from transformer_mt.errors import InputError
from transformer_mt.evaluation.engines import open_engine
from transformer_mt.files import decode_line
from transformer_mt.stops import Stopped


def stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def nbest_lines(number: int, hyps: list[tuple[str, float]]) -> str:
    """One sentence's n-best list in Moses' format: "<sentence number, from 0> ||| <translation> ||| <score>" lines."""
    return "".join(f"{number} ||| {text} ||| {score:.4f}\n" for text, score in hyps)


def translate(cfg: DictConfig) -> None:
    try:
        with open_engine(cfg) as (translate_lines, _):
            decoding = chosen_decoding(cfg, say=stderr)
            batch_lines = 1 if sys.stdin.isatty() else cfg.batch_lines  # at a terminal, each line as it is typed
            lines_done, start = 0, time.perf_counter()
            # Bytes split on "\n" only (U+0085 and friends inside a line are text), decoded line by line: an invalid
            # line ends the run with its number, after the lines before it are translated and written.
            while raw := list(itertools.islice(sys.stdin.buffer, batch_lines)):
                chunk, error = [], None
                for number, line in enumerate(raw, lines_done + 1):
                    try:
                        chunk.append(decode_line(line, number, "standard input"))
                    except InputError as e:
                        error = e
                        break
                results = translate_lines(
                    chunk,
                    warn=lambda message: stderr(f"warning: input {message}"),
                    first_line=lines_done + 1,
                    progress=sys.stderr.isatty() and batch_lines > 1,
                    n_best=cfg.n_best,
                    tokens_per_batch=cfg.tokens_per_batch,
                    **decoding.settings(),
                )
                for number, result in enumerate(results, lines_done):
                    sys.stdout.write(nbest_lines(number, result) if cfg.n_best else result + "\n")
                sys.stdout.flush()
                lines_done += len(chunk)
                if error:
                    raise InputError(f"{error}; the {lines_done} lines before it were translated and written")
    except Stopped as e:
        e.kept = "the translations written to standard output so far are whole lines"
        raise
    seconds = time.perf_counter() - start
    stderr(
        f"translated {lines_done} lines in {seconds:.1f} s ({lines_done / max(seconds, 1e-9):.1f} sentences/s, "
        f"beam {decoding.beam_size}, engine {cfg.engine})"
    )


main = hydra_command("translate", translate)  # make translate, transformer-mt-translate


if __name__ == "__main__":
    main()
