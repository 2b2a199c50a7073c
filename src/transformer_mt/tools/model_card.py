"""The model card every `make export` writes as README.md beside the weights: the Hugging Face Hub's front matter
(languages, tags, data set, a model-index of the run's scores with their sacreBLEU signatures), then what the model
is, how it was trained, how it scores and how to use the folder. The scores come from the run's results.json
(<run>/checkpoints/<name>.ckpt: the grandparent) when it scored this very checkpoint; else the card says it has none."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from transformer_mt.decoding import PAPER, Decoding
from transformer_mt.files import RunFolder
from transformer_mt.results import Results

# The weights' terms follow the training data's, not this project's MIT license: a placeholder the user replaces
# before uploading, which the export says.
LICENSE_NAME = "set-to-the-training-data-terms"
REPOSITORY = "<your-name>/<this-model>"  # the usage snippet's Hub repository: where the user uploads the folder
METRICS = {"bleu": "sacreBLEU", "chrf": "chrF"}  # results.json's key -> the card's name; signatures beside them
BLEU_NOTE = (
    "sacreBLEU is detokenized BLEU with its standard 13a tokenization, comparable across papers that state the "
    "same signature. The paper's 27.3/28.4 are tokenized BLEU with compounds split (tensor2tensor's "
    "get_ende_bleu.sh), usually a point or more higher on the same translations: the two are not comparable."
)


def run_scores(ckpt: Path) -> tuple[Path, Results, dict] | None:
    """(results.json, its content, its entry for ckpt) when ckpt's run scored this checkpoint, else None."""
    path = RunFolder(ckpt.resolve().parent.parent).results
    if not path.is_file():
        return None
    results = Results.read(path)
    entry = results.entry(ckpt)
    return (path, results, entry) if entry is not None else None


def scored_splits(entry: dict) -> dict[str, dict]:
    return {split: s for split, s in entry.items() if isinstance(s, dict) and "bleu" in s}


def card_data(data: dict, name: str, entry: dict | None):
    """The front matter as huggingface_hub's ModelCardData (a model-index entry per split and metric)."""
    from huggingface_hub import EvalResult, ModelCardData  # noqa: PLC0415 (the export extra's, with transformers)

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
        for split, score in scored_splits(entry or {}).items()  # the paper's settings' scores, not "tuned"
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


def recipe_lines(checkpoint: dict, data: dict, results: Results | None) -> list[str]:
    model = checkpoint["hyper_parameters"]["model"]
    averaged = checkpoint.get("averaged_from")
    lines = [
        f"- model: {model['n_encoder_layers']}+{model['n_decoder_layers']} layers, d_model {model['d_model']}, d_ff "
        f"{model['d_ff']}, {model['n_heads']} heads, a shared vocabulary of {model['vocab_size']} SentencePiece pieces"
        " (post-norm, ReLU, sinusoidal positions, tied embeddings)",
        f"- data: {data['name']} ({data['src_lang']} -> {data['tgt_lang']})",
        f"- updates: {checkpoint.get('global_step') or (results and results.updates) or 'unknown'}"
        + (f", weights averaged over {len(averaged)} checkpoints" if averaged else ""),
    ]
    if results:
        took, peak = timedelta(seconds=int(results.train_seconds)), results.peak
        lines.append(
            f"- training: {took}, {results.target_tokens:,} target tokens on {results.devices} device(s)"
            + (f"; {peak}" if peak else "")
        )
        overrides = [o for o in results.overrides or [] if not o.split("=")[0].endswith(("path", "dir"))]
        lines.append(f"- command-line overrides: `{' '.join(overrides) or '(none)'}` (local paths left out)")
    return lines


def usage(fmt: str) -> str:
    """The card's snippet: loads the model from its Hub repository (REPOSITORY, a placeholder; or a local folder)."""
    if fmt == "hf":
        return (
            "```python\nfrom transformers import MarianMTModel, MarianTokenizer\n\n"
            f'repository = "{REPOSITORY}"  # or the folder\'s path\n'
            "tokenizer = MarianTokenizer.from_pretrained(repository)\n"
            "model = MarianMTModel.from_pretrained(repository)\n"
            'batch = tokenizer(["A man is riding a bike."], return_tensors="pt")\n'
            "print(tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True))\n```"
        )
    return (
        "```python\nimport ctranslate2, sentencepiece\nfrom huggingface_hub import snapshot_download\n\n"
        f'folder = snapshot_download("{REPOSITORY}")  # or the folder\'s path\n'
        'sp = sentencepiece.SentencePieceProcessor(model_file=f"{folder}/sentencepiece.model")\n'
        "translator = ctranslate2.Translator(folder)\n"
        'pieces = sp.encode(["A man is riding a bike."], out_type=str)\n'
        f"results = translator.translate_batch(pieces, beam_size={PAPER.beam_size}, "
        f"length_penalty={PAPER.ct2_length_penalty:.2f})\n"
        "print([sp.decode_pieces(r.hypotheses[0]) for r in results])\n```"
    )


def score_row(label: str, s: dict) -> str:
    tokenized = s["tokenized_bleu_compound_split"]
    return f"| {label} | {s['sentences']:,} | {s['bleu']:.2f} | {s['chrf']:.2f} | {tokenized:.2f} |"


def model_card(ckpt: Path, checkpoint: dict, fmt: str, checked: str) -> str:
    """README.md for an export of ckpt (fmt hf or ct2); `checked`: what the export checked against ours."""
    data = checkpoint["hyper_parameters"]["config"]["data"]
    path, results, entry = run_scores(ckpt) or (None, None, None)
    name = f"transformer-mt {data['name']} {ckpt.stem}"
    kind = "transformers' MarianMTModel" if fmt == "hf" else "a CTranslate2 model"
    lines = [
        f"# {name}",
        "",
        f"A Transformer (Vaswani et al., 2017, base architecture family) trained with transformer-mt, "
        f"exported from `{ckpt.name}` as {kind}. At the export, {checked}.",
        "",
        "## Training",
        *recipe_lines(checkpoint, data, results),
        "",
        "## Scores",
    ]
    if entry:
        decoding = Decoding.of(results.decoding, where=str(path))
        splits = scored_splits(entry)
        lines += [f"From {path.name} (beam {decoding.beam_size}, alpha {decoding.alpha}):", ""]
        lines += [
            "| split | sentences | sacreBLEU | chrF | tokenized BLEU (compounds split) |",
            "|---|---|---|---|---|",
        ]
        lines += [score_row(split, s) for split, s in splits.items()]
        if "tuned" in entry:
            chosen = entry["tuned"]["decoding"]
            label = f"beam {chosen['beam_size']} and alpha {chosen['alpha']}, chosen on validation"
            lines += [score_row(f"{split}, {label}", t) for split, t in scored_splits(entry["tuned"]).items()]
        first = next(iter(splits.values()))
        lines += ["", f"Signatures: BLEU `{first['bleu_signature']}`, chrF `{first['chrf_signature']}`.", "", BLEU_NOTE]
    else:
        lines.append(
            "No scores: this checkpoint's run folder has no results.json that scored it (it was not the end-of-run "
            "protocol's model, or the checkpoint was moved out of its run). Score it with `make evaluate CKPT=...`."
        )
    lines += ["", "## Use", "", usage(fmt), ""]
    return f"---\n{card_data(data, name, entry).to_yaml()}\n---\n\n" + "\n".join(lines)
