"""FakeEngine's prefix cache (``prompt_tokens_details=True``) as a state machine against a plain model of it."""

from __future__ import annotations

from typing import List, Set, Tuple

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from lora_sampler.testing._sampling import PREFIX_BLOCK, PrefixCache

TOKENS = st.lists(st.integers(min_value=4, max_value=7), min_size=1, max_size=3 * PREFIX_BLOCK + 5)


class PrefixCacheMachine(RuleBasedStateMachine):
    """Cached tokens are whole blocks of a prefix served before for the same model, never the whole prompt."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = PrefixCache(entries=10_000)  # larger than any run here: nothing is forgotten
        self.seen: Set[Tuple[str, Tuple[int, ...]]] = set()

    @rule(model=st.sampled_from(["base", "lora-a"]), prompt=TOKENS, reuse=st.booleans())
    def serve(self, model: str, prompt: List[int], reuse: bool) -> None:
        if reuse and self.seen:
            earlier = sorted(self.seen)[len(prompt) % len(self.seen)]
            model, prompt = earlier[0], [*earlier[1], *prompt]
        expected = 0
        for end in range(PREFIX_BLOCK, len(prompt), PREFIX_BLOCK):
            if (model, tuple(prompt[:end])) not in self.seen:
                break
            expected = end
        assert self.cache.served(model, prompt) == expected
        for end in range(PREFIX_BLOCK, len(prompt) + 1, PREFIX_BLOCK):
            self.seen.add((model, tuple(prompt[:end])))

    @invariant()
    def never_the_whole_prompt(self) -> None:
        assert self.cache.served("never-seen", [4] * PREFIX_BLOCK) == 0
        self.seen.add(("never-seen", tuple([4] * PREFIX_BLOCK)))


PrefixCacheMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=15, deadline=None)
TestPrefixCache = PrefixCacheMachine.TestCase


def test_the_cache_is_bounded() -> None:
    cache = PrefixCache(entries=4)
    for start in range(10):
        cache.served("m", list(range(start, start + PREFIX_BLOCK)))
    assert cache.served("m", [*range(0, PREFIX_BLOCK), 99]) == 0  # the oldest prefixes were forgotten
    assert cache.served("m", [*range(9, 9 + PREFIX_BLOCK), 99]) == PREFIX_BLOCK
