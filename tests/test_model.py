"""The paper's model checked against independent references (docs/model.md)."""

import math

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from conftest import random_batch, tiny_config
from transformer_mt.attention_recording import explicit_attention, record_attention
from transformer_mt.configs import model_preset
from transformer_mt.model import Transformer, TransformerConfig, sinusoidal_positions, training_flops
from transformer_mt.objective import label_smoothed_nll

# ---------------------------------------------------------------- oracle: torch.nn.Transformer


def copy_attention(ours, theirs: nn.MultiheadAttention) -> None:
    theirs.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
    theirs.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.k_proj.bias, ours.v_proj.bias]))
    theirs.out_proj.load_state_dict(ours.out_proj.state_dict())


def reference_transformer(model: Transformer) -> nn.Transformer:
    """torch.nn.Transformer (ReLU; post-norm, or norm_first for model.norm=pre) holding a copy of our weights."""
    cfg = model.cfg
    pre = cfg.norm == "pre"
    ref = nn.Transformer(
        d_model=cfg.d_model,
        nhead=cfg.n_heads,
        num_encoder_layers=cfg.n_encoder_layers,
        num_decoder_layers=cfg.n_decoder_layers,
        dim_feedforward=cfg.d_ff,
        dropout=cfg.dropout,
        activation="relu",
        batch_first=True,
        norm_first=pre,
    )
    # nn.Transformer adds a final LayerNorm after each stack, which the paper's post-norm does not have
    # (pre-norm does: copied below), and its nested-tensor fast path zeroes padded encoder rows: off.
    if not pre:
        ref.encoder.norm = None
        ref.decoder.norm = None
    ref.encoder.use_nested_tensor = False
    with torch.no_grad():
        for ours, theirs in zip(model.encoder_layers, ref.encoder.layers):
            copy_attention(ours.self_attn, theirs.self_attn)
            theirs.linear1.load_state_dict(ours.ffn.w1.state_dict())
            theirs.linear2.load_state_dict(ours.ffn.w2.state_dict())
            theirs.norm1.load_state_dict(ours.self_attn_res.norm.state_dict())
            theirs.norm2.load_state_dict(ours.ffn_res.norm.state_dict())
        for ours, theirs in zip(model.decoder_layers, ref.decoder.layers):
            copy_attention(ours.self_attn, theirs.self_attn)
            copy_attention(ours.cross_attn, theirs.multihead_attn)
            theirs.linear1.load_state_dict(ours.ffn.w1.state_dict())
            theirs.linear2.load_state_dict(ours.ffn.w2.state_dict())
            theirs.norm1.load_state_dict(ours.self_attn_res.norm.state_dict())
            theirs.norm2.load_state_dict(ours.cross_attn_res.norm.state_dict())
            theirs.norm3.load_state_dict(ours.ffn_res.norm.state_dict())
        if pre:
            ref.encoder.norm.load_state_dict(model.encoder_norm.state_dict())
            ref.decoder.norm.load_state_dict(model.decoder_norm.state_dict())
    return ref.eval()


def test_matches_torch_nn_transformer_with_copied_weights():
    torch.manual_seed(0)
    model = Transformer(tiny_config()).eval()
    # Perturb LayerNorm affine parameters and biases so that copying them is tested too.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    ref = reference_transformer(model)
    src = random_batch([7, 4, 2], model.cfg.vocab_size, seed=1)  # padding on the source side
    tgt = random_batch([5, 9, 3], model.cfg.vocab_size, seed=2)  # other lengths, padded too
    src_pad, tgt_pad = src.eq(0), tgt.eq(0)
    causal = torch.ones(tgt.size(1), tgt.size(1), dtype=torch.bool).triu(1)  # True = blocked

    with torch.no_grad():
        memory, _ = model.encode(src)
        logits = model(src, tgt)
        ref_memory = ref.encoder(model.embed(src), src_key_padding_mask=src_pad)
        ref_hidden = ref.decoder(
            model.embed(tgt), ref_memory, tgt_mask=causal, tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad
        )
        ref_logits = ref_hidden @ model.embed.tokens.weight.T
        ref_hidden_nopad = ref.decoder(model.embed(tgt), ref_memory, tgt_mask=causal, memory_key_padding_mask=src_pad)
        ref_logits_nopad = ref_hidden_nopad @ model.embed.tokens.weight.T

    assert memory.shape == (3, 7, model.cfg.d_model) and logits.shape == (3, 9, 23)
    torch.testing.assert_close(memory, ref_memory, atol=1e-5, rtol=0)
    # With a target padding mask the reference differs only at padded target positions,
    # whose outputs are never used; causality already hides padding from real positions.
    real = ~tgt_pad
    torch.testing.assert_close(logits[real], ref_logits[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, ref_logits_nopad, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- §3.5 positions


def test_positions_known_values():
    pe = sinusoidal_positions(4, 512)
    torch.testing.assert_close(pe[1, :4], torch.tensor([0.8415, 0.5403, 0.8219, 0.5697]), atol=1e-4, rtol=0)
    torch.testing.assert_close(pe[0], torch.tensor([0.0, 1.0] * 256))  # sin 0, cos 0 interleaved


def test_positions_shift_is_a_fixed_rotation_and_dot_depends_only_on_offset():
    d, n = 512, 256
    pe = sinusoidal_positions(n, d).double()
    freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # omega_i
    for k in [1, 2, 7, 50]:
        c, s = torch.cos(k * freq), torch.sin(k * freq)
        sin_p, cos_p = pe[:-k, 0::2], pe[:-k, 1::2]
        # One rotation per frequency, the same for every pos:
        # [sin((p+k)w), cos((p+k)w)] = [[c, s], [-s, c]] @ [sin(pw), cos(pw)]
        torch.testing.assert_close(pe[k:, 0::2], c * sin_p + s * cos_p, atol=1e-6, rtol=0)
        torch.testing.assert_close(pe[k:, 1::2], -s * sin_p + c * cos_p, atol=1e-6, rtol=0)
        dots = (pe[:-k] * pe[k:]).sum(-1)  # PE(pos) . PE(pos + k) for every pos
        assert dots.max() - dots.min() < 1e-4
        assert dots[0].item() == pytest.approx(torch.cos(k * freq).sum().item(), abs=1e-4)


def test_embedding_is_scaled_by_sqrt_d_and_adds_positions(tiny_model):
    ids, d = random_batch([5, 3], tiny_model.cfg.vocab_size), tiny_model.cfg.d_model
    expected = tiny_model.embed.tokens.weight[ids] * math.sqrt(d) + sinusoidal_positions(64, d)[:5]
    torch.testing.assert_close(tiny_model.embed(ids), expected)
    with pytest.raises(ValueError, match="max_positions=64"):
        tiny_model.embed(torch.ones(1, 65, dtype=torch.long))


def test_dropout_applies_to_the_sum_of_embedding_and_position():
    torch.manual_seed(0)
    model = Transformer(tiny_config(dropout=0.5, d_model=64, vocab_size=50)).train()
    ids = random_batch([40] * 8, 50)
    clean = model.embed.tokens.weight[ids] * 8.0 + sinusoidal_positions(64, 64)[:40]
    out = model.embed(ids)
    dropped = out == 0
    assert 0.45 < dropped.float().mean() < 0.55  # P_drop = 0.5 on whole sum elements ...
    torch.testing.assert_close(out[~dropped], 2.0 * clean[~dropped])  # ... the rest scaled by 1 / (1 - p)


# ---------------------------------------------------------------- masks


def test_future_target_tokens_do_not_leak(tiny_model):
    src = random_batch([6, 4], 23, seed=1)
    tgt = random_batch([8, 8], 23, seed=2)
    logits = tiny_model(src, tgt)
    for t in [1, 4, 7]:
        changed = tgt.clone()
        changed[:, t:] = random_batch([8 - t, 8 - t], 23, seed=3 + t)
        assert not torch.equal(changed, tgt)
        other = tiny_model(src, changed)
        torch.testing.assert_close(other[:, :t], logits[:, :t], atol=1e-6, rtol=0)
        assert not torch.allclose(other[:, t:], logits[:, t:])  # the test can fail


def test_padded_source_positions_do_not_leak(tiny_model):
    """In fp64, where sums over more (masked) keys in another order differ by ~1e-16, not fp32's ~1e-6 (at 1 thread
    on an AVX2 CPU): a pad that leaked into attention would move the outputs by ~1."""
    model = tiny_model.double()
    src = random_batch([6, 3], 23, seed=1)
    tgt = random_batch([5, 2], 23, seed=2)
    real = tgt.ne(0)
    logits = model(src, tgt)
    memory, _ = model.encode(src)
    # More padding columns change nothing.
    wider = torch.cat([src, torch.zeros(2, 4, dtype=torch.long)], dim=1)
    torch.testing.assert_close(model(wider, tgt), logits, atol=1e-12, rtol=0)
    # Changing what stands at padded positions (the pad row's vector) changes no real output.
    with torch.no_grad():
        model.embed.tokens.weight[0] = torch.randn(model.cfg.d_model, dtype=torch.float64)
    memory2, _ = model.encode(src)
    src_real = src.ne(0)
    assert not torch.allclose(memory2[~src_real], memory[~src_real])  # padded rows did change
    torch.testing.assert_close(memory2[src_real], memory[src_real], atol=1e-12, rtol=0)
    # (class 0's logit is the pad row itself through the tied projection, so it is left out)
    torch.testing.assert_close(model(src, tgt)[real][:, 1:], logits[real][:, 1:], atol=1e-12, rtol=0)


def test_all_padding_row_gives_finite_outputs_and_gradients():
    torch.manual_seed(0)
    model = Transformer(tiny_config()).train()
    src = random_batch([4, 0], 23)  # the second source is entirely padding
    tgt = random_batch([3, 3], 23, seed=1)
    logits = model(src, tgt)
    assert torch.isfinite(logits).all()
    logits.logsumexp(-1).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_recorded_attention_equals_sdpa_and_its_weights_are_distributions(tiny_model, monkeypatch):
    src = random_batch([7, 3, 1], 23, seed=1)  # padded rows
    tgt = random_batch([5, 6, 2], 23, seed=2)
    expected = tiny_model(src, tgt)
    with record_attention(tiny_model) as kinds:
        got = tiny_model(src, tgt)
        weights = {kind: [a.weights for a in layers] for kind, layers in kinds.items()}
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert [len(w) for w in weights.values()] == [2, 3, 3]
    src_pad = src.eq(0)[:, None, None, :]
    for kind, layers in weights.items():
        for w in layers:
            assert w.shape[:2] == (3, 4)  # (B, H, rows, keys)
            torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1]))
            if kind == "decoder":
                assert (w.triu(diagonal=1) == 0).all() and (w.diagonal(dim1=-2, dim2=-1) > 0).all()
            else:
                assert (w.masked_select(src_pad.expand_as(w)) == 0).all() and (w[~src_pad.expand_as(w)] > 0).all()
    # Outside the block: nothing kept, and the normal path never computes weights.
    assert all(a.weights is None and not a.recording for layers in kinds.values() for a in layers)
    monkeypatch.setattr("transformer_mt.model.explicit_attention", lambda *a: pytest.fail("explicit path used"))
    torch.testing.assert_close(tiny_model(src, tgt), expected, atol=0, rtol=0)


def test_explicit_attention_gives_zeros_where_every_key_is_masked_as_sdpa():
    q, k, v = torch.randn(3, 2, 1, 3, 4).unbind(0)  # (B=2, H=1, L=3, hd=4) each
    mask = torch.tensor([[True, False, True], [False, False, False]])[:, None, None, :]  # (B, 1, 1, keys)
    out, weights = explicit_attention(q, k, v, mask, causal=False)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    assert (weights[1] == 0).all() and (out[1] == 0).all()


# ---------------------------------------------------------------- incremental decoding


def test_cached_decoding_equals_full_forward(tiny_model):
    src = random_batch([7, 3, 5], 23, seed=1)
    tgt = random_batch([9, 9, 9], 23, seed=2)
    full = tiny_model(src, tgt)  # (B, T, V)
    state = tiny_model.start_decoding(*tiny_model.encode(src))
    for t in range(tgt.size(1)):
        step = tiny_model.decode_step(tgt[:, t], state)
        torch.testing.assert_close(step, full[:, t], atol=1e-5, rtol=0)
    assert state.length == 9 and state.layers[0].self_kv[0].shape == (3, 4, 9, tiny_model.cfg.d_model // 4)


def test_reordered_cache_continues_like_the_reordered_batch(tiny_model):
    src = random_batch([7, 3, 5], 23, seed=1)
    tgt = random_batch([6, 6, 6], 23, seed=2)
    rows = torch.tensor([2, 2, 0])  # as beam search does: duplicate one row, drop another
    full = tiny_model(src[rows], tgt[rows])
    state = tiny_model.start_decoding(*tiny_model.encode(src))
    for t in range(3):
        tiny_model.decode_step(tgt[:, t], state)
    state.select(rows, sentences=rows)
    for t in range(3, 6):
        torch.testing.assert_close(tiny_model.decode_step(tgt[rows, t], state), full[:, t], atol=1e-5, rtol=0)


def test_beams_share_their_sentence_memory_through_reorders_and_departures(tiny_model):
    """beam=2: rows are grouped by sentence and attend to one copy of its memory; after beams are
    reordered within sentences and a sentence leaves, decoding continues like the full forward
    pass of the rows that remain."""
    src = random_batch([7, 3, 5], 23, seed=1)
    tgt = random_batch([6] * 6, 23, seed=2)
    rows = torch.arange(3).repeat_interleave(2)  # hypothesis row -> its sentence
    full = tiny_model(src[rows], tgt)
    state = tiny_model.start_decoding(*tiny_model.encode(src))
    for t in range(3):
        torch.testing.assert_close(tiny_model.decode_step(tgt[:, t], state), full[:, t], atol=1e-5, rtol=0)
    assert state.layers[0].memory_kv[0].size(0) == 3  # one memory per sentence, not per beam
    kept = torch.tensor([1, 1, 5, 4])  # sentence 0: its second beam twice; sentence 1 leaves; sentence 2 swapped
    state.select(kept, sentences=torch.tensor([0, 2]))
    full = tiny_model(src[rows[kept]], tgt[kept])
    for t in range(3, 6):
        torch.testing.assert_close(tiny_model.decode_step(tgt[kept, t], state), full[:, t], atol=1e-5, rtol=0)


# ---------------------------------------------------------------- §3.4 weight tying and §5 init


def test_one_embedding_matrix_serves_encoder_decoder_and_output():
    torch.manual_seed(0)
    model = Transformer(tiny_config(dropout=0.0)).eval()
    emb = model.embed.tokens.weight
    assert model.output_weight.untyped_storage().data_ptr() == emb.untyped_storage().data_ptr()
    vocab_shaped = [n for n, p in model.named_parameters() if p.shape[0] == 23]
    assert vocab_shaped == ["embed.tokens.weight"]  # stored once, not three copies
    assert [k for k in model.state_dict() if "embed" in k] == ["embed.tokens.weight"]

    # Changing row 5 of that one matrix changes the encoder input, the decoder input and logit 5.
    src, tgt_with_5, tgt_without_5 = torch.tensor([[5, 6]]), torch.tensor([[5, 7]]), torch.tensor([[8, 7]])
    memory, _ = model.encode(src)
    logits_5, logits_no5 = model(torch.tensor([[6]]), tgt_with_5), model(torch.tensor([[6]]), tgt_without_5)
    with torch.no_grad():
        emb[5] += torch.randn(model.cfg.d_model)  # not a constant: LayerNorm outputs sum to zero
    assert not torch.allclose(model.encode(src)[0], memory)  # encoder input
    assert not torch.allclose(model(torch.tensor([[6]]), tgt_with_5), logits_5)  # decoder input (+ output)
    after = model(torch.tensor([[6]]), tgt_without_5)  # token 5 only as an output class
    assert not torch.allclose(after[..., 5], logits_no5[..., 5])
    torch.testing.assert_close(after[..., :5], logits_no5[..., :5])  # other classes unchanged


def test_initialisation():
    torch.manual_seed(0)
    cfg = tiny_config(vocab_size=4000, d_model=64, d_ff=256, pad_id=3)
    model = Transformer(cfg)
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            bound = math.sqrt(6 / (module.in_features + module.out_features))  # Xavier uniform
            w = module.weight
            assert w.abs().max() <= bound, name
            assert w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.1), name
            assert torch.count_nonzero(module.bias) == 0, name
    emb = model.embed.tokens.weight
    assert torch.count_nonzero(emb[3]) == 0  # pad row
    assert emb.std().item() == pytest.approx(64**-0.5, rel=0.02)  # N(0, d^-0.5)
    assert emb.mean().abs().item() < 0.01


def test_config_rejects_inconsistent_values():
    with pytest.raises(ValueError, match="divisible"):
        TransformerConfig(vocab_size=10, d_model=10, n_heads=4)


@pytest.mark.parametrize("name, paper_params", [("base", 65e6), ("big", 213e6)])
def test_parameter_count_matches_table_3(name, paper_params, capsys):
    cfg = TransformerConfig(vocab_size=37000, **model_preset(name))
    with torch.device("meta"):  # count without allocating 213M parameters
        n = sum(p.numel() for p in Transformer(cfg).parameters())
    with capsys.disabled():
        print(f"\n{name}: {n:,} parameters with a 37,000-token shared vocabulary (paper: {paper_params / 1e6:.0f}M)")
    assert abs(n - paper_params) / paper_params < 0.04


SWITCHES = [{}, dict(d_k=3, d_v=5), dict(d_k=6, d_v=10, positions="learned", norm="pre", share_embeddings="none")]


@pytest.mark.parametrize("switches", SWITCHES, ids=["paper", "d_k=3,d_v=5", "every-switch"])
def test_training_flops_equal_torchs_flop_counter_but_for_the_causal_half(switches):
    """model.training_flops against torch.utils.flop_counter on a training step (forward with the reference loss,
    whose output product the counter sees: F.linear_cross_entropy's chunked op computes the same products out of its
    sight; backward). With no padding and the MATH attention backend, the only difference is the masked half of
    decoder self-attention, which runs but does no useful work (training_flops counts T(T+1)/2 pairs, the counter
    T^2); each pair costs 2 (H d_k + H d_v) in the forward pass (4 d_model in the paper's model)."""
    cfg = tiny_config(vocab_size=50, dropout=0.0, **switches)
    model = Transformer(cfg)
    B, S, T = 3, 7, 5
    src, tgt_in, tgt_out = (random_batch([n] * B, 50, seed=i) for i, n in enumerate((S, T, T)))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss, _, _ = label_smoothed_nll(model(src, tgt_in), tgt_out, 0.1)
        loss.backward()
    ours = training_flops(cfg, torch.full((B,), S), torch.full((B,), T))
    a, b = (cfg.n_heads * size for size in cfg.head_sizes)
    masked_half = 3 * 2 * (a + b) * cfg.n_decoder_layers * B * (T * T - T * (T + 1) / 2)
    assert counter.get_total_flops() == ours + masked_half
    # Padding is not work: a sentence's count does not depend on the batch it is padded in.
    one = training_flops(cfg, torch.tensor([S]), torch.tensor([T]))
    assert training_flops(cfg, torch.tensor([S, 2]), torch.tensor([T, 3])) > one
    assert training_flops(cfg, torch.tensor([S, S]), torch.tensor([T, T])) == 2 * one
