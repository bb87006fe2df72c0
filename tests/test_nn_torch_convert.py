"""slicedkern.nn.torch.convert_attention: every nn.MultiheadAttention of a model replaced by a
SlicedAttention with its projections, and torch's transformer layers calling the result as they
call their attention (padding masks made float, causal masks, need_weights=False, the fast path)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from slicedkern.nn.torch import SlicedAttention, convert_attention  # noqa: E402

F64 = torch.float64
#: torch's own warning when it builds an encoder whose layers are not batch_first (before any conversion)
NESTED_WARNING = "ignore:enable_nested_tensor is True:UserWarning"


def count(model, cls):
    return sum(isinstance(m, cls) for m in model.modules())


class Nested(nn.Module):
    """A custom model: one attention deep in containers (cross-attention, kdim/vdim), one at the top."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleDict({"cross": nn.Sequential(nn.Identity(), nn.ModuleList(
            [nn.MultiheadAttention(16, 2, kdim=6, vdim=10, batch_first=True, dtype=F64)]))})
        self.attn = nn.MultiheadAttention(16, 4, bias=False, dtype=F64)
        self.head = nn.Linear(16, 3, dtype=F64)

    def forward(self, x, memory, pad):
        x = x + self.blocks["cross"][1][0](x, memory[..., :6], memory, key_padding_mask=pad)[0]
        y = x.transpose(0, 1)
        return self.head(x + self.attn(y, y, y, need_weights=False)[0].transpose(0, 1))


MODELS = {
    "transformer": lambda: nn.Transformer(16, 4, 2, 1, 32, dropout=0.0, batch_first=True, dtype=F64),
    "encoder": lambda: nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True, dtype=F64), 3),
    "nested": Nested,
}


@pytest.mark.parametrize("name", MODELS)
def test_every_attention_replaced_in_place(name):
    model = MODELS[name]()
    before = count(model, nn.MultiheadAttention)
    assert before == {"transformer": 2 + 2, "encoder": 3, "nested": 2}[name]
    assert convert_attention(model) is model
    assert count(model, nn.MultiheadAttention) == 0
    assert count(model, SlicedAttention) == before


@pytest.mark.parametrize("kind", ["packed", "separate", "no_bias"])
def test_projections_copied_exactly(kind):
    args = {"packed": {}, "separate": {"kdim": 6, "vdim": 10}, "no_bias": {"bias": False}}[kind]
    mha = nn.MultiheadAttention(12, 3, dropout=0.25, batch_first=True, dtype=F64, **args)
    with torch.no_grad():
        for p in mha.parameters():          # biases are zero at init: make every entry distinct
            p.copy_(torch.randn_like(p))
    layer = convert_attention(mha)
    assert isinstance(layer, SlicedAttention)
    assert (layer.embed_dim, layer.num_heads, layer.kdim, layer.vdim) == (12, 3, mha.kdim, mha.vdim)
    assert layer.batch_first and layer.dropout == 0.25 and layer.q_proj.weight.dtype == F64
    if mha._qkv_same_embed_dim:
        weights = mha.in_proj_weight.split(12)
    else:
        weights = (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
    for linear, weight in zip((layer.q_proj, layer.k_proj, layer.v_proj), weights):
        assert torch.equal(linear.weight, weight)
    assert torch.equal(layer.out_proj.weight, mha.out_proj.weight)
    if kind == "no_bias":
        assert all(m.bias is None for m in (layer.q_proj, layer.k_proj, layer.v_proj, layer.out_proj))
    else:
        for linear, bias in zip((layer.q_proj, layer.k_proj, layer.v_proj), mha.in_proj_bias.split(12)):
            assert torch.equal(linear.bias, bias)
        assert torch.equal(layer.out_proj.bias, mha.out_proj.bias)
    # copies, not shared storage: training the sliced layer leaves the original alone
    assert layer.q_proj.weight.data_ptr() != mha.out_proj.weight.data_ptr()
    assert not any(p is q for p in layer.parameters() for q in mha.parameters())


@pytest.mark.filterwarnings(NESTED_WARNING)
@pytest.mark.parametrize("batch_first", [True, False])
def test_transformer_trains_and_evaluates(batch_first):
    torch.manual_seed(0)
    model = convert_attention(nn.Transformer(16, 4, 2, 2, 32, dropout=0.0, batch_first=batch_first, dtype=F64),
                              kernel="hat")
    src, tgt = torch.randn(3, 9, 16, dtype=F64), torch.randn(3, 5, 16, dtype=F64)
    if not batch_first:
        src, tgt = src.transpose(0, 1), tgt.transpose(0, 1)
    pad = torch.zeros(3, 9, dtype=torch.bool)
    pad[1, 6:] = True
    masks = {"tgt_mask": nn.Transformer.generate_square_subsequent_mask(5, dtype=F64),
             "src_key_padding_mask": pad, "memory_key_padding_mask": pad}
    out = model(src, tgt, **masks)
    out.square().sum().backward()
    score_grads = [m.score_out.weight.grad for m in model.modules() if isinstance(m, SlicedAttention)]
    assert len(score_grads) == 6 and all(g is not None and g.abs().sum() > 0 for g in score_grads)
    model.eval()
    with torch.no_grad():
        evaluated = model(src, tgt, **masks)
    torch.testing.assert_close(evaluated, out.detach())       # dropout 0: the same function
    # the causal mask is applied: changing the last target token leaves the earlier ones alone
    changed = tgt.clone()
    changed[(slice(None), -1) if batch_first else (-1,)] += 1.0
    with torch.no_grad():
        moved = model(src, changed, **masks)
    first = (slice(None), slice(0, 4)) if batch_first else (slice(0, 4),)
    torch.testing.assert_close(moved[first], evaluated[first])
    assert not torch.allclose(moved, evaluated)


@pytest.mark.filterwarnings(NESTED_WARNING)
@pytest.mark.parametrize("batch_first", [True, False])
def test_encoder_eval_takes_no_fast_path(batch_first):
    """In eval mode without gradients torch's encoder would run its fused softmax kernel on nested
    tensors from the stale in_proj weights; the converted encoder computes sliced attention, with the
    (float-converted) padding mask applied."""
    torch.manual_seed(1)
    layer = nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=batch_first, dtype=F64)
    model = convert_attention(nn.TransformerEncoder(layer, 2, enable_nested_tensor=True))
    assert model.use_nested_tensor is False
    x = torch.randn(3, 9, 16, dtype=F64)
    pad = torch.zeros(3, 9, dtype=torch.bool)
    pad[0, 5:] = True
    pad[2, 8:] = True
    noise = torch.where(pad[..., None], torch.randn_like(x), torch.zeros_like(x))
    if not batch_first:
        x, noise = x.transpose(0, 1), noise.transpose(0, 1)
    trained = model(x, src_key_padding_mask=pad)
    model.eval()
    with torch.no_grad():
        out = model(x, src_key_padding_mask=pad)
        one = model.layers[0](x, src_key_padding_mask=pad)
        other = model(x + noise, src_key_padding_mask=pad)        # only padded tokens changed
    torch.testing.assert_close(out, trained.detach())
    sliced = model.layers[0].self_attn
    torch.testing.assert_close(one, model.layers[0].norm2(
        (h := model.layers[0].norm1(x + sliced(x, x, x, key_padding_mask=pad)[0]))
        + model.layers[0]._ff_block(h)))
    real = ~pad if batch_first else (~pad).T
    torch.testing.assert_close(other[real], out[real])


def test_decoder_layer_equals_fresh_layers():
    """Both attentions of a converted decoder layer, called as the layer calls them (float padding
    mask, causal mask), equal fresh SlicedAttention layers built with the same arguments and loaded
    with their weights, called directly with boolean masks."""
    torch.manual_seed(2)
    layer = convert_attention(nn.TransformerDecoderLayer(12, 3, 24, dropout=0.0, batch_first=True, dtype=F64),
                              kernel="hat_mixture", score="linear")
    fresh = {}
    for name in ("self_attn", "multihead_attn"):
        attention = getattr(layer, name)
        fresh[name] = SlicedAttention(12, 3, kernel="hat_mixture", score="linear", batch_first=True, dtype=F64)
        with torch.no_grad():
            for p in attention.parameters():
                p.add_(0.1 * torch.randn_like(p))           # move off the initial bandwidths and weights
        fresh[name].load_state_dict(attention.state_dict())
    x, memory = torch.randn(2, 6, 12, dtype=F64), torch.randn(2, 8, 12, dtype=F64)
    pad = torch.tensor([[False] * 8, [False] * 5 + [True] * 3])
    causal = nn.Transformer.generate_square_subsequent_mask(6, dtype=F64)
    out = layer(x, memory, tgt_mask=causal, memory_key_padding_mask=pad, tgt_is_causal=True)
    h = layer.norm1(x + fresh["self_attn"](x, x, x, is_causal=True)[0])
    h = layer.norm2(h + fresh["multihead_attn"](h, memory, memory, key_padding_mask=pad)[0])
    torch.testing.assert_close(out, layer.norm3(h + layer._ff_block(h)))


def test_options_pass_through():
    model = convert_attention(MODELS["encoder"](), kernel="hat", bandwidth=0.5, score="linear", rope=True)
    for m in model.modules():
        if isinstance(m, SlicedAttention):
            assert m.config.kernel_name == "hat" and m.config.rope and m.score_hidden is None
            torch.testing.assert_close(m.log_bandwidth.exp(), torch.full((4,), 0.5, dtype=F64))
    relu = convert_attention(MODELS["encoder"]())
    assert all(m.config.kernel_name == "relu" and m.log_bandwidth is None
               for m in relu.modules() if isinstance(m, SlicedAttention))


@pytest.mark.parametrize(("options", "error", "match"), [
    ({"kernal": "hat"}, TypeError, "kernal"),
    ({"dropout": 0.1}, TypeError, "'dropout' is taken"),
    ({"batch_first": False}, TypeError, "'batch_first' is taken"),
    ({"kernel": "softmax"}, ValueError, "'kernel'"),
    ({"kernel": "relu", "bandwidth": 1.0}, ValueError, "'bandwidth'"),
])
def test_bad_option_named(options, error, match):
    model = MODELS["encoder"]()
    with pytest.raises(error, match=match):
        convert_attention(model, **options)


def test_model_without_attention():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match="holds no torch.nn.MultiheadAttention"):
        convert_attention(model)
    converted = convert_attention(MODELS["encoder"]())
    with pytest.raises(ValueError, match="holds no"):         # a second conversion finds nothing left
        convert_attention(converted)


def test_shared_attention_stays_shared():
    mha = nn.MultiheadAttention(8, 2)
    model = nn.ModuleList([mha, nn.Sequential(mha)])
    convert_attention(model)
    assert isinstance(model[0], SlicedAttention) and model[1][0] is model[0]


def test_unsupported_attention_options():
    with pytest.raises(ValueError, match="add_bias_kv"):
        convert_attention(nn.Sequential(nn.MultiheadAttention(8, 2, add_bias_kv=True)))
    with pytest.raises(TypeError, match="MultiheadAttention"):
        SlicedAttention.from_multihead_attention(nn.Linear(2, 2))


def test_layer_takes_multihead_attention_calls():
    """What converted models pass to SlicedAttention: positional masks, float padding masks, an
    unflagged causal mask; other float or general masks stay errors."""
    torch.manual_seed(3)
    layer = SlicedAttention(8, 2, kernel="hat", batch_first=True, dtype=F64)
    x = torch.randn(2, 5, 8, dtype=F64)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    expected = layer(x, x, x, key_padding_mask=pad)[0]
    torch.testing.assert_close(layer(x, x, x, pad, False)[0], expected)
    float_pad = torch.zeros(2, 5, dtype=F64).masked_fill(pad, float("-inf"))
    torch.testing.assert_close(layer(x, x, x, key_padding_mask=float_pad)[0], expected)
    causal = layer(x, x, x, is_causal=True)[0]
    assert not torch.allclose(causal, layer(x, x, x)[0])
    for mask in (nn.Transformer.generate_square_subsequent_mask(5, dtype=F64),
                 torch.ones(5, 5, dtype=torch.bool).triu(1), torch.ones(4, 5, 5, dtype=torch.bool).triu(1)):
        torch.testing.assert_close(layer(x, x, x, attn_mask=mask)[0], causal)
    with pytest.raises(TypeError, match="'key_padding_mask' must be a boolean mask"):
        layer(x, x, x, key_padding_mask=pad.to(F64))                   # 0 / 1: not torch's float form
    with pytest.raises(ValueError, match="attn_mask"):
        layer(x, x, x, attn_mask=torch.ones(5, 5, dtype=torch.bool).tril(-1))     # anti-causal
