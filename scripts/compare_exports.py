"""How close the exports translate to us: share of identical sentences and sacreBLEU on a test set.

    .venv/bin/python scripts/compare_exports.py outputs/m30k/checkpoints/last.ckpt \\
        --src ../shared/data/multi30k/test_2016_flickr.en --ref ../shared/data/multi30k/test_2016_flickr.de

Exports the checkpoint (make export, both formats) into a temporary folder, translates the
source file with our beam search and with transformers' MarianMTModel.generate and
CTranslate2 (float32 and int8) at beam 1 and beam 4, and prints one table. transformers and
CTranslate2 divide a hypothesis' log-probability by |Y|^alpha, we by GNMT's ((5 + |Y|) / 6)^alpha,
so each beam-4 setting of theirs is compared with ours at the alpha named in `vs ours`.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import sacrebleu

from transformer_mt.checkpoint import load_for_inference
from transformer_mt.data.corpus import read_text_pair
from transformer_mt.peers import ct2_translate, hf_translate
from transformer_mt.search import translate_lines
from transformer_mt.tools.export import export, optional


def ours(model, tokenizer, sources, beam: int, alpha: float) -> list[str]:
    return translate_lines(model, tokenizer, sources, beam_size=beam, alpha=alpha)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt")
    parser.add_argument("--src", required=True)
    parser.add_argument("--ref", required=True)
    parser.add_argument("--limit", type=int, help="the first N sentences only")
    parser.add_argument("--alphas", default="0,0.6,0.45", help="their length penalties (|Y|^alpha) to try at beam 4")
    args = parser.parse_args()
    transformers, ctranslate2 = optional("transformers"), optional("ctranslate2")
    sources, references = read_text_pair(args.src, args.ref)
    sources, references = sources[: args.limit], references[: args.limit]
    model, tokenizer, _ = load_for_inference(args.ckpt)
    their_alphas = [float(a) for a in args.alphas.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, ct2_dir = export(args.ckpt, "hf", f"{tmp}/hf"), export(args.ckpt, "ct2", f"{tmp}/ct2")
        hf = transformers.MarianMTModel.from_pretrained(hf_dir).eval()
        hf_tokenizer = transformers.MarianTokenizer.from_pretrained(hf_dir)
        ct2 = {
            kind: ctranslate2.Translator(str(ct2_dir), device="cpu", compute_type=kind) for kind in ("float32", "int8")
        }
        systems = {
            "transformers fp32": lambda beam, alpha: hf_translate(hf, hf_tokenizer, sources, beam, alpha),
            "CTranslate2 fp32": lambda beam, alpha: ct2_translate(ct2["float32"], tokenizer.sp, sources, beam, alpha),
            "CTranslate2 int8": lambda beam, alpha: ct2_translate(ct2["int8"], tokenizer.sp, sources, beam, alpha),
        }
        print(f"{len(sources)} sentences of {args.src}; {args.ckpt}")
        print(f"{'system':<18} {'beam':>4} {'alpha':>5} {'vs ours':>12} {'identical':>9} {'BLEU':>6} {'sent/s':>7}")

        def report(system: str, beam: int, alpha: float, hyps: list[str], seconds: float, ours_key=None) -> None:
            same = f"{100 * sum(h == r for h, r in zip(hyps, baseline[ours_key])) / len(hyps):.1f}%" if ours_key else ""
            versus = f"beam {ours_key[0]} a={ours_key[1]}" if ours_key else ""
            bleu = sacrebleu.corpus_bleu(hyps, [references]).score
            print(
                f"{system:<18} {beam:>4} {alpha:>5.2f} {versus:>12} {same:>9} {bleu:>6.2f} {len(hyps) / seconds:>7.1f}"
            )

        baseline = {}
        for beam, alpha in [(1, 0.0), (4, 0.6), (4, 0.0)]:
            start = time.perf_counter()
            baseline[(beam, alpha)] = ours(model, tokenizer, sources, beam, alpha)
            report("ours", beam, alpha, baseline[(beam, alpha)], time.perf_counter() - start)
        for system, run in systems.items():
            for beam, alpha in [(1, 0.0)] + [(4, a) for a in their_alphas]:
                start = time.perf_counter()
                hyps = run(beam, alpha)
                ours_key = (1, 0.0) if beam == 1 else (4, 0.0 if alpha == 0 else 0.6)
                report(system, beam, alpha, hyps, time.perf_counter() - start, ours_key)


if __name__ == "__main__":
    main()
