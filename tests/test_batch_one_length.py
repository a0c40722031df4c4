"""batch_one_length and RowEnds: where a batched row's batch-1 generation would have stopped, as lm-eval's
criterion decides."""
import random

import pytest
import torch
from lm_eval.models.utils_hf import stop_sequences_criteria
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from evalsuite.lm.dropping import RowEnds, batch_one_length

PIECES = ["12", " + ", "7", " = ", "19", "\n", "\n\n", "Question:", " The answer is", ".", " ok"]


def step_by_step(tokenizer, generated, stop, eos):
    """lm-eval's criterion called after every token, as a batch-1 generation calls it."""
    criteria = stop_sequences_criteria(tokenizer, stop, 0, 1)
    for n in range(1, len(generated) + 1):
        if generated[n - 1] in eos or any(c(torch.tensor([generated[:n]]), None) for c in criteria):
            return n
    return len(generated)


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE whose tokens span several characters ("\n\n" is one token, "\n" "\n" two): a stop
    sequence may then be generated in another tokenization than its own, which the criterion's look-back
    of two extra tokens is there for."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(PIECES * 50, trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")


def test_rows_stop_where_the_step_by_step_criterion_stops(tokenizer):
    rng = random.Random(0)
    stop, eos = ["\n\n", "Question:"], {tokenizer.eos_token_id}
    lengths = set()
    for _ in range(60):
        chosen = [rng.choice(PIECES) for _ in range(rng.randint(1, 12))]
        text = "".join(chosen)  # each piece its own tokens: "\n" "\n" is not the token of "\n\n"
        generated = [t for piece in chosen for t in tokenizer.encode(piece, add_special_tokens=False)]
        if rng.random() < 0.3:
            generated.insert(rng.randrange(len(generated) + 1), tokenizer.eos_token_id)
        expected = step_by_step(tokenizer, generated, stop, eos)
        assert batch_one_length(tokenizer, generated, stop, eos) == expected, text
        ends = RowEnds(tokenizer, stop, eos, 1)  # the same rule, as the tokens come
        for n in range(1, len(generated) + 1):
            ends.update([0], torch.tensor([generated[:n]]))
        assert (ends.length[0] or len(generated)) == expected, text
        lengths.add(expected == len(generated))
    assert lengths == {True, False}  # rows that stop early and rows that run to their end were both checked
