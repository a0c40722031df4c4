"""The lm-eval adapter takes every engine option, list-valued ones written `recall_k=1;2;8`."""
import pytest
from lm_eval.api.registry import get_model

import evalsuite.lm  # noqa: F401  (registers specmoe)

from .helpers import shipped_model


def test_list_options_reach_the_engine():
    args = f"pretrained={shipped_model()},mode=speculative,cache_capacity=0.5,recall_k=1;2,preserve_layers=0"
    lm = get_model("specmoe").create_from_arg_string(args, {"batch_size": 1, "device": "cpu"})
    try:
        assert lm.engine.driver.recall_ks == (1, 2)
        assert lm.engine.driver.preserve == {0}
    finally:
        lm.engine.close()


@pytest.mark.parametrize("arg, words", [("recall_k=1;two", "recall_k='1;two' must be whole numbers separated by ';'"),
                                        ("recall_k=0", "recall_k=[0] must be a list of whole numbers of at least 1")])
def test_a_bad_list_is_refused_in_one_line(arg, words):
    with pytest.raises(ValueError, match=r"^specmoe: ") as info:
        get_model("specmoe").create_from_arg_string(f"pretrained={shipped_model()},mode=speculative,{arg}",
                                                    {"batch_size": 1, "device": "cpu"})
    assert words in str(info.value) and "\n" not in str(info.value)
