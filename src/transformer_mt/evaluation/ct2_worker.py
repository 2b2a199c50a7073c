"""The CTranslate2 process behind engine=ct2 (engines.py starts it): `python -m transformer_mt.evaluation.ct2_worker`.

It imports CTranslate2 and SentencePiece, never torch: two OpenMP runtimes in one process slowed both
(scripts/benchmark.py's decode_worker says by how much). It reads JSON lines on stdin and answers each with
one on stdout. First {"model": <export folder>, "device": auto|cpu|cuda..., "threads": N, "compute_type": ...},
answered {"ready": true, "device": ..., "torch_imported": false}; then one request per chunk of lines
{"lines": [...], "beam_size", "length_penalty", "max_len_a", "max_len_b", "max_source_tokens", "tokens_per_batch"},
answered {"outputs": [...], "truncated": [(line index, tokens)]}. A failure is answered {"error": "..."}.
"""

from __future__ import annotations

import json
import sys


def load(request: dict):
    import ctranslate2  # noqa: PLC0415 (the module must import without it: engines.py names the extra)
    import sentencepiece  # noqa: PLC0415

    device = request["device"]
    if device == "auto":
        device = "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
    kind, _, index = device.partition(":")
    translator = ctranslate2.Translator(
        request["model"],
        device=kind,
        device_index=int(index or 0),
        compute_type=request["compute_type"],
        intra_threads=request["threads"],
    )
    sp = sentencepiece.SentencePieceProcessor(model_file=f"{request['model']}/sentencepiece.model")
    return translator, sp, device


def translate(translator, sp, request: dict) -> dict:
    """Like search.translate_lines: stripped lines, empty ones stay empty, sources cut to the model's
    positions; length-sorted chunks of at most tokens_per_batch (sentences x beam x longest source), each
    with its own limit a * longest + b tokens before EOS (ours is per sentence, CTranslate2's per call)."""
    beam, limit = request["beam_size"], request["max_source_tokens"]
    pieces = [sp.encode(line.strip(), out_type=str) for line in request["lines"]]
    truncated = [(i, len(p)) for i, p in enumerate(pieces) if len(p) > limit]
    pieces = [p[:limit] for p in pieces]
    order = sorted((i for i, p in enumerate(pieces) if p), key=lambda i: len(pieces[i]))
    outputs = [""] * len(pieces)
    start = 0
    while start < len(order):
        end = start + 1
        while (
            end < len(order) and (end - start + 1) * beam * (len(pieces[order[end]]) + 1) <= request["tokens_per_batch"]
        ):
            end += 1
        chunk = [pieces[i] for i in order[start:end]]
        longest = max(map(len, chunk))
        results = translator.translate_batch(
            chunk,
            beam_size=beam,
            length_penalty=request["length_penalty"],
            max_batch_size=len(chunk),
            max_decoding_length=int(request["max_len_a"] * longest + request["max_len_b"]),  # EOS not counted
        )
        for i, result in zip(order[start:end], results):
            outputs[i] = sp.decode_pieces(result.hypotheses[0])
        start = end
    return {"outputs": outputs, "truncated": truncated}


def main() -> None:
    import os  # noqa: PLC0415

    # Answers go out on a copy of stdout; stdout itself goes to stderr, so that nothing a library prints
    # can break the protocol.
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    state = None
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if state is None:
                state = load(request)
                answer = {"ready": True, "device": state[2], "torch_imported": "torch" in sys.modules}
            else:
                answer = translate(state[0], state[1], request)
        except Exception as e:  # noqa: BLE001 (the parent reports it; this process only answers)
            answer = {"error": f"{type(e).__name__}: {e}"}
        answers.write(json.dumps(answer, ensure_ascii=False) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
