"""transformer-mt: the original Transformer (Vaswani et al., 2017) for WMT14 English-German.

A map of the package. The core is what every part uses; the front doors are the commands
(Hydra stops there: below them, plain typed arguments); four wings build on the core.

core
    model.py                the Transformer of §3 in plain PyTorch, its config, and its FLOP count
    settings.py             the model's settings typed (conf/model's keys): Hydra composes the group onto them
    decoding_state.py       the incremental-decoding cache: each decoder layer's keys/values between steps
    attention_recording.py  attention weights made visible (record_attention, §3.2.1 written out)
    objective.py            label-smoothed loss (§5.4), the teacher-forced loss of a batch, Noam rate (§5.3)
    decoding.py             the decoding settings of §6.1 as one type (Decoding), the paper's written once; no torch
    search.py               greedy and beam search (§6.1), translating in length-sorted batches
    tokenizer.py            the shared SentencePiece vocabulary (§5.1), and the model's input layout in ids
    checkpoint.py           checkpoint files: atomic writes, safe reads, averaging, a model for inference
    scoring.py              sacreBLEU, chrF and the paper's tokenized BLEU
    results.py              results.json, the end-of-run protocol's record, as one type (Results)
    errors.py               errors a user can act on, reported in one line; the option commands' parser
    stops.py                the stop signals, their handlers, the exit status; Lightning's loop state (only here)
    files.py                atomic writes, stale temporaries, UTF-8 line reading, a run's folder (RunFolder)
    runtime.py              devices, threads, CPU features, glibc's allocator, the process's end
    launcher.py             which launcher started the process (torchrun, srun), its job's name, the Hydra job,
                            whether a GPU can be there (read without torch)
front doors (make train/evaluate/tune/translate/finish/average; transformer-mt-* commands): Hydra stops here
    train.py  evaluate.py  tune.py  translate.py  averaging.py  finish.py  (train.py runs training/fit.py)
    configs.py      where the Hydra configs live, their resolvers; composing them outside an entry point
    commandline.py  a command line checked before torch; Hydra's job and decoding settings handed down as types
data/               corpus reading and cleaning (a split's text for scoring), token-bucket batching, the DataModule
training/           the LightningModule, callbacks (progress, run end), logs, exact resume, FSDP, a time budget
evaluation/         what is done to a trained checkpoint, without Lightning: engines, the tune grid, the end-of-run
                    protocol and results.json
tools/              export (transformers, CTranslate2), attention maps, learning curves, the Table 3 collector
"""

import sys

if sys.argv[:1] == ["-m"] or (sys.argv or [""])[0].rpartition("/")[2].startswith("transformer-mt-"):  # a command
    from transformer_mt.stops import stop_quietly

    stop_quietly()
