"""transformer-mt: the original Transformer (Vaswani et al., 2017) for WMT14 English-German.

A map of the package. The core is what every part uses; the front doors are the commands
(Hydra stops there: below them, plain typed arguments); three wings build on the core.

core
    model.py                the Transformer of §3 in plain PyTorch, its config, and its FLOP count
    decoding_state.py       the incremental-decoding cache: each decoder layer's keys/values between steps
    attention_recording.py  attention weights made visible (record_attention, §3.2.1 written out)
    objective.py            label-smoothed loss (§5.4), the teacher-forced loss of a batch, Noam rate (§5.3)
    search.py               greedy and beam search (§6.1), source batches, translating in length-sorted batches
    length_penalties.py     beam search's length penalty, ours (GNMT) and the exports' |Y|^a; without torch
    tokenizer.py            the shared SentencePiece vocabulary (§5.1)
    checkpoint.py           checkpoint files: atomic writes, safe reads, a model for inference
    scoring.py              sacreBLEU, chrF and the paper's tokenized BLEU
    tuning.py               decoding settings chosen on the development set, stored beside the checkpoint
    errors.py               errors a user can act on, reported in one line
    files.py                atomic writes, stale temporaries, UTF-8 line reading
    runtime.py              devices, threads, CPU features, glibc's allocator
    configs.py              where the Hydra configs live; composing them outside an entry point
    commandline.py          an entry point's command line checked before torch: typos, Trainer arguments, GPU
    launcher.py             which launcher started the process (torchrun, srun) and its job's name
front doors (make train/evaluate/tune/translate/finish/average; transformer-mt-* commands)
    train.py  evaluate.py  tune.py  translate.py  averaging.py  finish.py  (train.py runs training/fit.py)
    engines.py      evaluate/translate's decoder: ours, or CTranslate2 (engine=ct2) in ct2_worker.py's process
data/               corpus reading and cleaning, token-bucket batching, the LightningDataModule
training/           the LightningModule, callbacks (progress, run end), logs, exact resume, FSDP
tools/              export (transformers, CTranslate2), attention maps, learning curves
"""
