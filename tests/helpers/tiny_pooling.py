"""Tiny random-weight pooling models saved as sentence-transformers folders (the parity references).

A WordPiece tokenizer over a small vocabulary (BERT's specials, letters, a few words), a BERT or XLM-R
encoder saved with sentence-transformers' own `save` (modules.json, 1_Pooling/config.json, 2_Normalize),
a decoder saved the same way with last-token pooling, and cross-encoders saved by transformers.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch

from tests.helpers.tiny_models import make_tiny_model

_WORDS = ["the", "cat", "dog", "sat", "on", "mat", "what", "is", "paris", "capital", "of", "france", "berlin"]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *string.ascii_lowercase, *string.digits, ".", ",", "?", "!"]
VOCAB += [f"##{c}" for c in string.ascii_lowercase + string.digits] + _WORDS
TEXTS = [
    "the cat sat on the mat.",
    "what is the capital of france?",
    "paris",
    "a dog, a cat and berlin!",
    "zebra quartz 42",
]


def save_wordpiece_tokenizer(path: Path, token_types: bool = True) -> Any:
    """`token_types=False`: XLM-R's tokenizers give no token_type_ids (its models have one type)."""
    from transformers import BertTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    names = ["input_ids", "token_type_ids", "attention_mask"] if token_types else ["input_ids", "attention_mask"]
    # the vocabulary as a dict: transformers 5 ignores `vocab_file=` here (every word became [UNK])
    vocab = {token: i for i, token in enumerate(VOCAB)}
    tok = BertTokenizerFast(vocab=vocab, do_lower_case=True, model_input_names=names)
    tok.save_pretrained(str(path))
    return tok


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Wider weights than HF's init (0.02), and LayerNorms/biases off their defaults, so that every tensor
    matters to the output and a mis-loaded one shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def _encoder_config(kind: str, **overrides: Any) -> Any:
    from transformers import BertConfig, XLMRobertaConfig

    common = dict(
        vocab_size=len(VOCAB),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        pad_token_id=0,
    )
    if kind == "bert":
        return BertConfig(**{**common, "max_position_embeddings": 128, **overrides})
    # XLM-R: positions start at pad_token_id + 1 ([PAD] is 0 in this vocabulary), one token type
    return XLMRobertaConfig(**{**common, "max_position_embeddings": 130, "type_vocab_size": 1, **overrides})


def make_st_encoder(
    root: Path, kind: str = "bert", pooling: str = "mean", normalize: bool = True, seed: int = 0
) -> str:
    """A sentence-transformers folder of a tiny BERT (or XLM-R) encoder; returns its path."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import BertModel, XLMRobertaModel

    hf_dir = root / f"hf-{kind}"
    torch.manual_seed(seed)
    config = _encoder_config(kind)
    model = (BertModel if kind == "bert" else XLMRobertaModel)(config).eval()
    _randomize(model, seed)
    model.save_pretrained(str(hf_dir))
    save_wordpiece_tokenizer(hf_dir, token_types=kind == "bert")
    modules: list[Any] = [Transformer(str(hf_dir)), Pooling(64, pooling_mode=pooling)]
    if normalize:
        modules.append(Normalize())
    out = root / f"st-{kind}-{pooling}"
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return str(out)


def make_st_decoder(root: Path, seed: int = 0) -> str:
    """A sentence-transformers folder of a tiny Qwen3 decoder, last-token pooling + Normalize."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import Qwen3Config

    config = Qwen3Config(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    hf_dir = make_tiny_model(root / "hf-qwen3", config, seed)
    _drop_chat_template(Path(hf_dir))
    modules = [Transformer(hf_dir), Pooling(64, pooling_mode="lasttoken"), Normalize()]
    out = root / "st-qwen3-last"
    SentenceTransformer(modules=modules, device="cpu").save(str(out))
    return str(out)


def make_cross_encoder(root: Path, kind: str = "bert", seed: int = 0) -> str:
    """A tiny one-label cross-encoder (BertForSequenceClassification / XLMRobertaForSequenceClassification)."""
    from transformers import BertForSequenceClassification, XLMRobertaForSequenceClassification

    torch.manual_seed(seed)
    cls = BertForSequenceClassification if kind == "bert" else XLMRobertaForSequenceClassification
    model = cls(_encoder_config(kind, num_labels=1)).eval()
    _randomize(model, seed)
    path = root / f"ce-{kind}"
    model.save_pretrained(str(path))
    save_wordpiece_tokenizer(path, token_types=kind == "bert")
    return str(path)


def _drop_chat_template(path: Path) -> None:
    """sentence-transformers 6 wraps plain texts in a tokenizer's chat template; embedding folders of plain
    decoders carry none (the byte tokenizer's is for generation tests)."""
    import json

    (path / "chat_template.jinja").unlink(missing_ok=True)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    config_file.write_text(json.dumps(config))


# vLLM's hf_overrides that run the original Qwen3-Reranker (a causal LM) as a yes/no scorer
QWEN3_RERANKER_OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}


def _tiny_qwen3_config(**overrides: Any) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**{
        "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, **overrides,
    })  # fmt: skip


def save_yes_no_tokenizer(path: Path) -> Any:
    """The byte-level tokenizer (tests/helpers/tiny_models.py) with merges that make "yes" and "no" single
    tokens, as Qwen's BPE has them; pairs are plain concatenations (no special tokens), as Qwen's tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet())):
        vocab[ch] = 3 + i
    merges = [("y", "e"), ("ye", "s"), ("n", "o")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", pad_token="</s>")
    fast.save_pretrained(str(path))
    return fast


def make_qwen3_reranker(root: Path, tied: bool = True, seed: int = 0) -> str:
    """A tiny random Qwen3ForCausalLM as the original Qwen3-Reranker ships (scored by its "yes"/"no" logits
    under QWEN3_RERANKER_OVERRIDES), with the yes/no tokenizer."""
    path = Path(make_tiny_model(root / f"qwen3-reranker-{'tied' if tied else 'untied'}",
                                _tiny_qwen3_config(tie_word_embeddings=tied), seed))  # fmt: skip
    _drop_chat_template(path)
    save_yes_no_tokenizer(path)
    return str(path)


def make_qwen3_seq_cls(root: Path, seed: int = 0) -> str:
    """A tiny random one-label Qwen3ForSequenceClassification (a reranker converted to a stored score head)."""
    from transformers import Qwen3ForSequenceClassification

    torch.manual_seed(seed)
    model = Qwen3ForSequenceClassification(_tiny_qwen3_config(num_labels=1)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # RMSNorms near 1 (hidden states of unit scale), the rest wide: scores spread out
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.3 * noise if "norm" in name else 0.15 * noise)
    path = root / "qwen3-seq-cls"
    model.save_pretrained(str(path))
    save_yes_no_tokenizer(path)
    return str(path)
