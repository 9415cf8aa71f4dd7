"""List-valued flags parse the same whichever way fire hands them over."""

import pytest

from runner.args import int_list, items
from runner.errors import PmxError


@pytest.mark.parametrize("value", ["0,1,39", "0 1 39", (0, 1, 39), [0, "1", 39]])
def test_int_list_forms(value):
    assert int_list(value, "dump_steps") == [0, 1, 39]


def test_int_list_edges_and_errors():
    assert int_list(None, "dump_steps") == [] and int_list("", "dump_steps") == [] and int_list(7, "x") == [7]
    with pytest.raises(PmxError, match=r"--batch_sizes must be positive integers separated by commas or spaces, got '1,0'"):
        int_list("1,0", "batch_sizes", minimum=1)
    with pytest.raises(PmxError, match="--batch_sizes must be positive integers"):
        int_list("", "batch_sizes", minimum=1, allow_empty=False)
    with pytest.raises(PmxError, match=r"--dump_steps must be integers >= 0 .* got 'a,1'"):
        int_list("a,1", "dump_steps")
    assert items("logits,kv_cache") == ["logits", "kv_cache"] and items(("logits",)) == ["logits"]
