"""The README.md model card of every export: the Hub's front matter, then the model, its training, its scores (from
its run's results.json when that scored this checkpoint) and how to use the folder."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from transformer_mt.decoding import PAPER, Decoding
from transformer_mt.files import RunFolder
from transformer_mt.results import Results

# The weights' terms follow the training data's, not this project's license: a placeholder the user replaces.
LICENSE_NAME = "set-to-the-training-data-terms"
REPOSITORY = "<your-name>/<this-model>"  # the usage snippet's Hub repository
METRICS = {"bleu": "sacreBLEU", "chrf": "chrF"}
USAGE = {
    "hf": f"""from transformers import MarianMTModel, MarianTokenizer

repository = "{REPOSITORY}"  # or the folder's path
tokenizer = MarianTokenizer.from_pretrained(repository)
model = MarianMTModel.from_pretrained(repository)
batch = tokenizer(["A man is riding a bike."], return_tensors="pt")
print(tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True))""",
    "ct2": f"""import ctranslate2, sentencepiece
from huggingface_hub import snapshot_download

folder = snapshot_download("{REPOSITORY}")  # or, for the folder itself: folder = "<its path>"
sp = sentencepiece.SentencePieceProcessor(model_file=f"{{folder}}/sentencepiece.model")
translator = ctranslate2.Translator(folder)
pieces = sp.encode(["A man is riding a bike."], out_type=str)
results = translator.translate_batch(pieces, beam_size={PAPER.beam_size}, length_penalty={PAPER.ct2_length_penalty:.2f})
print([sp.decode_pieces(r.hypotheses[0]) for r in results])""",
}


def card_data(data: dict, name: str, splits: dict[str, dict]):
    """The front matter: huggingface_hub's ModelCardData, a model-index entry per split and metric."""
    from huggingface_hub import EvalResult, ModelCardData  # noqa: PLC0415 (the export extra's)

    src, tgt, dataset = data["src_lang"], data["tgt_lang"], data["hub_name"] or data["name"]
    results = [
        EvalResult(
            task_type="translation",
            task_name=f"Translation {src}-{tgt}",
            dataset_type=dataset,
            dataset_name=data["name"],
            dataset_config=data["hub_config"],
            dataset_split=split,
            metric_type=key,
            metric_name=metric,
            metric_value=score[key],
            metric_config=score[f"{key}_signature"],
            verified=False,
        )
        for split, score in splits.items()
        for key, metric in METRICS.items()
    ]
    return ModelCardData(
        language=[src, tgt],
        tags=["translation", "transformer", "transformer-mt"],
        datasets=[dataset],
        metrics=list(METRICS),
        pipeline_tag="translation",
        model_name=name,
        eval_results=results or None,
        license="other",
        license_name=LICENSE_NAME,
    )


def model_card(ckpt: Path, checkpoint: dict, fmt: str, checked: str) -> str:
    """README.md for an export of ckpt (fmt hf or ct2); `checked`: what the export checked against ours."""
    data, model = checkpoint["hyper_parameters"]["config"]["data"], checkpoint["hyper_parameters"]["model"]
    path = RunFolder(ckpt.resolve().parent.parent).results  # <run>/checkpoints/<name>.ckpt
    results = Results.read(path) if path.is_file() else None
    splits = results.scores_of(ckpt) if results else {}
    results = results if splits else None  # the run's figures only where it scored this checkpoint
    name, averaged = f"transformer-mt {data['name']} {ckpt.stem}", checkpoint.get("averaged_from")
    kind = "transformers' MarianMTModel" if fmt == "hf" else "a CTranslate2 model"
    lines = [
        f"# {name}",
        "",
        f"A Transformer (Vaswani et al., 2017, base architecture family) trained with transformer-mt, exported from "
        f"`{ckpt.name}` as {kind}. At the export, {checked}.",
        "",
        "## Training",
        f"- model: {model['n_encoder_layers']}+{model['n_decoder_layers']} layers, d_model {model['d_model']}, d_ff "
        f"{model['d_ff']}, {model['n_heads']} heads, a shared vocabulary of {model['vocab_size']} SentencePiece pieces"
        f" ({model.get('norm', 'post')}-norm, ReLU, sinusoidal positions, tied embeddings)",
        f"- data: {data['name']} ({data['src_lang']} -> {data['tgt_lang']})",
        f"- updates: {checkpoint.get('global_step') or (results and results.updates) or 'unknown'}"
        + (f", weights averaged over {len(averaged)} checkpoints" if averaged else ""),
    ]
    if results:
        given = "not recorded"
        if results.overrides is not None:
            overrides = [o for o in results.overrides if not o.split("=")[0].endswith(("path", "dir"))]
            given = f"`{' '.join(overrides) or '(none)'}` (local paths left out)"
        lines += [
            f"- training: {timedelta(seconds=int(results.train_seconds))}, {results.target_tokens:,} target tokens on "
            f"{results.devices} device(s)" + (f"; {results.peak}" if results.peak else ""),
            f"- command-line overrides: {given}",
        ]
    lines += ["", "## Scores"]
    if results:
        decoding, first = Decoding.of(results.decoding, where=str(path)), next(iter(splits.values()))
        header = "| split | sentences | sacreBLEU | chrF | tokenized BLEU (compounds split) |\n|---|---|---|---|---|"
        lines += [f"From {path.name} ({decoding.text()}):", "", header]
        for split, s in splits.items():
            tokenized = s["tokenized_bleu_compound_split"]
            lines.append(f"| {split} | {s['sentences']:,} | {s['bleu']:.2f} | {s['chrf']:.2f} | {tokenized:.2f} |")
        lines += [
            "",
            f"Signatures: BLEU `{first['bleu_signature']}`, chrF `{first['chrf_signature']}`.",
            "",
            "sacreBLEU is detokenized BLEU with its standard 13a tokenization, comparable across papers that state the "
            "same signature. The paper's 27.3/28.4 are tokenized BLEU with compounds split (tensor2tensor's "
            "get_ende_bleu.sh), usually a point or more higher on the same translations: the two are not comparable.",
        ]
    else:
        lines.append(
            "No scores: this checkpoint's run folder has no results.json that scored it (it was not the end-of-run "
            "protocol's model, or the checkpoint was moved out of its run). Score it with `make evaluate CKPT=...`."
        )
    lines += ["", "## Use", "", f"```python\n{USAGE[fmt]}\n```", ""]
    return f"---\n{card_data(data, name, splits).to_yaml()}\n---\n\n" + "\n".join(lines)
