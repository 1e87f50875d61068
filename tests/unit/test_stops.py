import pytest

from mlxd.executor.stops import StopMatcher


def run(stops: list[str], pieces: list[str]) -> tuple[str, str | None]:
    """Feed pieces one by one as the model thread does; return what a client would see."""
    matcher = StopMatcher(stops)
    seen = []
    for piece in pieces:
        text, stop = matcher.feed(piece)
        seen.append(text)
        if stop is not None:
            return "".join(seen), stop
    return "".join(seen) + matcher.flush(), None


def test_no_stops_passes_text_through():
    assert run([], ["Hello", " world"]) == ("Hello world", None)


def test_stop_inside_one_piece():
    assert run(["END"], ["abcENDdef"]) == ("abc", "END")


@pytest.mark.parametrize("text", ["Paris.\nUser: hi", "x\n\nUser: y"])
def test_stop_split_at_every_position(text):
    stop = "\nUser:"
    expected = text[: text.index(stop)]
    for cut in range(1, len(text)):
        for cut2 in range(cut, len(text) + 1):
            pieces = [text[:cut], text[cut:cut2], text[cut2:]]
            assert run([stop], pieces) == (expected, stop), pieces


def test_partial_stop_is_held_then_released():
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("abST") == ("ab", None)
    assert matcher.feed("AR") == ("STAR", None)


def test_partial_stop_flushed_at_end():
    assert run(["STOP"], ["abc", "ST"]) == ("abcST", None)


def test_earliest_of_several_stops_wins():
    assert run(["world", "lo w"], ["hello world"]) == ("hel", "lo w")


def test_empty_stop_strings_are_ignored():
    assert run(["", "x"], ["abxc"]) == ("ab", "x")


def test_one_char_pieces_never_leak_a_stop_prefix():
    text, stop = run(["</s>"], list("answer</s>more"))
    assert (text, stop) == ("answer", "</s>")
