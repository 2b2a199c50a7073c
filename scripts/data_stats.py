"""Batching statistics for a data configuration, with the same Hydra overrides as training.

  python scripts/data_stats.py data=multi30k data.path=../shared/data/multi30k data.max_tokens=4096

Prints split sizes, tokenization time (cold, then cached), batches per epoch, padding
efficiency (real / padded tokens over both sides) and the derived gradient accumulation. It trains
nothing, so it writes no run folder (the config is composed, not run by Hydra).
"""

import sys
import time

from omegaconf import DictConfig, OmegaConf

from transformer_mt.configs import compose
from transformer_mt.data.batching import TokenBucketSampler
from transformer_mt.data.corpus import SPLITS
from transformer_mt.data.datamodule import TranslationDataModule


def padding_efficiency(sampler: TokenBucketSampler) -> float:
    """Real tokens / padded tokens over both sides of every batch of the current epoch."""
    real = padded = 0
    for batch in sampler.rank_batches():
        s, t = sampler.src_lens[batch], sampler.tgt_lens[batch]
        real += s.sum() + t.sum()
        padded += len(batch) * (s.max() + t.max())
    return float(real / padded)


def build(cfg: DictConfig) -> tuple[TranslationDataModule, float]:
    dm = TranslationDataModule(**OmegaConf.to_container(cfg.data, resolve=True))
    start = time.perf_counter()
    dm.build()
    return dm, time.perf_counter() - start


def main(cfg: DictConfig) -> None:
    first, first_s = build(cfg)
    _, cached_s = build(cfg)
    was_cached = all(how == "loaded from cache" for how, _ in first.cache.timings.values())
    sizes = ", ".join(f"{split} {len(first.splits[split]):,}" for split in SPLITS)
    print(f"data: {cfg.data.name} ({sizes} pairs), vocabulary {len(first.tokenizer):,}")
    if was_cached:
        print(
            f"tokenization: cold not measured (cache already present under {first.cache_dir}; "
            f"set data.cache_dir to an empty directory to time it), cached {cached_s:.2f} s"
        )
    else:
        print(f"tokenization: cold {first_s:.2f} s (SentencePiece + ids, cache written), cached {cached_s:.2f} s")
    sampler = first.sampler("train", shuffle=True)
    world = int(cfg.get("world_size", 1))
    batch_tokens, accumulation = first.update_shape(world)
    print(f"tokens per batch: {batch_tokens} per side; train batches per epoch: {len(sampler):,}")
    print(f"padding efficiency: {padding_efficiency(sampler):.3f}")
    print(
        f"accumulation: {accumulation} batches x {batch_tokens} tokens x {world} device(s) "
        f"= {accumulation * batch_tokens * world:,} padded tokens per side per update "
        f"(target {cfg.data.tokens_per_update})"
    )


if __name__ == "__main__":
    main(compose("train", sys.argv[1:]))
