"""fullshard's product code leans on no part of torch that changes between releases in
the ways that broke it before (Note [the calls of an optimizer step]): it walks no Python
frames, reads no code object of torch's, and unwraps no function torch wrapped."""

import pathlib

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "fullshard"

# sys._getframe: a caller's frame (which step call is running); profile_hook_step:
# torch's private wrapper around Optimizer.step; __wrapped__: the function behind a wrapper
FORBIDDEN = ("_getframe", "profile_hook_step", "__wrapped__")


def test_the_product_code_walks_no_frames_and_unwraps_nothing():
    # fullshard.testing is test machinery, not the product: its NCCL-rules checker names
    # the collective its caller ran from the caller's frame
    found = [f"{path.relative_to(SRC)}:{n}: {word}"
             for path in sorted(SRC.rglob("*.py")) if "testing" not in path.relative_to(SRC).parts
             for n, line in enumerate(path.read_text().splitlines(), 1)
             for word in FORBIDDEN if word in line]
    assert not found, "\n".join(found)
