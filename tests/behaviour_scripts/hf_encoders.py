"""transformers encoders and encoder-decoders: BERT, T5, ViT (a forward and backward each)."""

import _results
import torch
import transformers
from transformers import (
    BertConfig,
    BertForMaskedLM,
    T5Config,
    T5ForConditionalGeneration,
    ViTConfig,
    ViTForImageClassification,
)

transformers.logging.set_verbosity_error()
torch.manual_seed(0)

bert = BertForMaskedLM(
    BertConfig(
        num_hidden_layers=2,
        num_attention_heads=2,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=100,
        max_position_embeddings=32,
    )
)
ids = torch.randint(0, 100, (2, 10))
out = bert(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
out.loss.backward()
print("bert loss", repr(out.loss.item()))
_results.add("bert", [out.logits, [p.grad for p in bert.parameters()]])

t5 = T5ForConditionalGeneration(
    T5Config(
        d_model=32,
        d_ff=64,
        d_kv=8,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        vocab_size=100,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
)
src = torch.randint(1, 100, (2, 8))
tgt = torch.randint(1, 100, (2, 6))
out = t5(input_ids=src, labels=tgt)
out.loss.backward()
print("t5 loss", repr(out.loss.item()))
_results.add("t5", [out.logits, [p.grad for p in t5.parameters() if p.grad is not None]])

vit = ViTForImageClassification(
    ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=5,
    )
)
pixels = torch.randn(2, 3, 16, 16)
out = vit(pixel_values=pixels, labels=torch.tensor([1, 3]))
out.loss.backward()
print("vit loss", repr(out.loss.item()))
_results.add("vit", [out.logits, [p.grad for p in vit.parameters()]])
_results.finish()
