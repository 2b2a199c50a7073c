"""engine=ct2's process (engines.CT2Process starts it); imports CTranslate2 and SentencePiece, never torch.

JSON lines on stdin, one answer each on stdout: first {"model", "device", "threads", "compute_type"}, answered
{"ready", "device", "torch_imported"}; then {"lines", "beam_size", "length_penalty", "max_len_a", "max_len_b",
"max_source_tokens", "tokens_per_batch"}, answered {"outputs", "truncated": [(line index, tokens)]}; or {"error"}.
"""

from __future__ import annotations

import json
import os
import signal
import sys


def load(request: dict):
    import ctranslate2  # noqa: PLC0415 (the module must import without it: engines.py names the extra)
    import sentencepiece  # noqa: PLC0415

    device = request["device"]
    if device == "auto":
        device = "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
    kind, _, index = device.partition(":")
    options = dict(compute_type=request["compute_type"], intra_threads=request["threads"])
    translator = ctranslate2.Translator(request["model"], device=kind, device_index=int(index or 0), **options)
    sp = sentencepiece.SentencePieceProcessor(model_file=f"{request['model']}/sentencepiece.model")
    return translator, sp, {"ready": True, "device": device, "torch_imported": "torch" in sys.modules}


def translate(translator, sp, request: dict) -> dict:
    """As search.translate_lines batches; the length limit is per batch (a x its longest + b), ours per sentence."""
    beam, limit = request["beam_size"], request["max_source_tokens"]
    pieces = [sp.encode(line.strip(), out_type=str) for line in request["lines"]]
    truncated = [(i, len(p)) for i, p in enumerate(pieces) if len(p) > limit]
    pieces = [p[:limit] for p in pieces]
    order = sorted((i for i, p in enumerate(pieces) if p), key=lambda i: len(pieces[i]))
    outputs, start = [""] * len(pieces), 0
    while start < len(order):
        end = start + 1  # grow the batch while (sentences x beam x longest) fits tokens_per_batch
        while (
            end < len(order) and (end - start + 1) * beam * (len(pieces[order[end]]) + 1) <= request["tokens_per_batch"]
        ):
            end += 1
        chunk = [pieces[i] for i in order[start:end]]
        longest = max(map(len, chunk))  # the limit, a x longest + b, counts no EOS
        results = translator.translate_batch(
            chunk,
            beam_size=beam,
            length_penalty=request["length_penalty"],
            max_batch_size=len(chunk),
            max_decoding_length=int(request["max_len_a"] * longest + request["max_len_b"]),
        )
        for i, result in zip(order[start:end], results):
            outputs[i] = sp.decode_pieces(result.hypotheses[0])
        start = end
    return {"outputs": outputs, "truncated": truncated}


def main() -> None:
    # Answers go to a copy of stdout; stdout itself to stderr, so that nothing a library prints breaks the protocol.
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the whole process group: the parent stops, we follow
    state = None
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if state is None:
                *state, answer = load(request)
            else:
                answer = translate(*state, request)
        except Exception as e:  # noqa: BLE001 (the parent reports it; this process only answers)
            answer = {"error": f"{type(e).__name__}: {e}"}
        answers.write(json.dumps(answer, ensure_ascii=False) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
