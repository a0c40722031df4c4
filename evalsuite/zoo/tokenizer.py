"""Character-level tokenizer built with the `tokenizers` library.

One token per character keeps prompt/answer boundaries identical between training
and evaluation (no merge can straddle the point where generation starts), and
makes digit-by-digit arithmetic learnable for a tiny model.
"""
from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, EOS, UNK]
# Printable ASCII covers every generator and any Python a model may emit.
CHARACTERS = sorted(set(string.printable) - set("\r\x0b\x0c"))


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    # BPE without merges splits any string into single characters.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.add_special_tokens(SPECIAL_TOKENS)
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
