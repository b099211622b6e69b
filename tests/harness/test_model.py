"""``LoraSamplerLM`` on FakeEngine: the three request types as lm-eval's API models compute them, through the client.

Expected numbers come from the client itself (``sample`` with prompt logprobs, greedy generation) on the same engine,
so each test checks the translation (the split, the windows, ``is_greedy``, the generation kwargs), not the fake's
arithmetic.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, List, Tuple

import pytest
from _lm_eval_tasks import write_byte_tokenizer
from lm_eval.api.instance import Instance
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from lora_sampler import SamplerClient
from lora_sampler._wire.routes import COMPLETIONS_PATH, TOKENIZE_PATH
from lora_sampler.lm_eval import LoraSamplerLM, TokenCache
from lora_sampler.lm_eval._model import MODEL_ARGS
from lora_sampler.testing import ByteTokenizer, FakeEngine, write_adapter_archive


def instances(kind: str, arguments: List[Tuple[Any, ...]]) -> List[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(arguments)]


def expected_score(client: SamplerClient, tokens: List[int], start: int, **model: Any) -> float:
    """The sum of the prompt logprobs of ``tokens[start:]``, by the client directly."""
    output = client.sample(tokens, max_tokens=1, prompt_logprobs=True, **model)
    assert output.prompt_logprobs is not None
    return sum(output.prompt_logprobs[start:])  # type: ignore[arg-type]


def test_loglikelihood_is_lm_evals_split_scored_by_the_adapter(
    engine: FakeEngine, checkpoint: str, lora_dir: Path
) -> None:
    """The context's trailing space moves to the continuation; the adapter's logprobs of the continuation tokens.
    The texts tokenized first, many at once, are those lm-eval's split asks for: no other reaches /tokenize."""
    lm = LoraSamplerLM(base_url=engine.url, adapter=checkpoint, lora_base_dir=str(lora_dir), prompts_per_request=1)
    engine.reset_log()
    answers = lm.loglikelihood(instances("loglikelihood", [("Two plus two is ", "four"), ("The sky", " is blue")]))
    assert engine.calls(TOKENIZE_PATH) == 4  # "Two plus two is", "Two plus two is four", "The sky", "The sky is blue"
    with SamplerClient(engine.url, lora_base_dir=lora_dir) as client:
        whole = list(client.tokenize("Two plus two is four", add_special_tokens=False))
        context = list(client.tokenize("Two plus two is", add_special_tokens=False))
        first = expected_score(client, whole, len(context), adapter=checkpoint)
        base = expected_score(client, whole, len(context), base_model=engine.model)
        second = expected_score(client, [4 + byte for byte in b"The sky is blue"], len("The sky"), adapter=checkpoint)
    assert answers[0][0] == pytest.approx(first, abs=1e-9) and answers[0][0] != pytest.approx(base)
    assert answers[1][0] == pytest.approx(second, abs=1e-9)
    assert all(isinstance(greedy, bool) for _, greedy in answers)


def test_is_greedy_is_true_for_the_engines_own_greedy_continuation(engine: FakeEngine) -> None:
    """A continuation the engine generates greedily is greedy; one other token in it is not."""
    with SamplerClient(engine.url) as client:
        generated = client.sample("Once upon", base_model=engine.model, max_tokens=4, temperature=0.0)
    tokens = list(generated.sequences[0].tokens)
    lm = LoraSamplerLM(base_url=engine.url, prefix_token_id=1)
    context = lm.tok_encode("Once upon")
    other = [*tokens[:-1], tokens[-1] + 1 if tokens[-1] + 1 < 1024 else tokens[-1] - 1]
    answers = lm._loglikelihood_tokens([(None, context, tokens), (None, context, other)])
    assert answers[0][1] is True and answers[1][1] is False
    assert answers[0][0] == pytest.approx(sum(generated.sequences[0].logprobs), abs=1e-6)


def test_results_in_input_order_and_each_text_tokenized_once(engine: FakeEngine) -> None:
    """Many requests, batched: answers in input order; each distinct text reaches /tokenize once, in a shared cache."""
    pairs = [(f"Question {i % 5}:", f" answer {i}") for i in range(40)]
    cache_client = SamplerClient(engine.url)
    cache = TokenCache(cache_client)
    lm = LoraSamplerLM(client=cache_client, token_cache=cache, prompts_per_request=8)
    engine.reset_log()
    answers = lm.loglikelihood(instances("loglikelihood", pairs))
    again = LoraSamplerLM(client=cache_client, token_cache=cache).loglikelihood(instances("loglikelihood", pairs[::-1]))
    distinct = {context for context, _ in pairs} | {context + cont for context, cont in pairs}
    assert engine.calls(TOKENIZE_PATH) == len(distinct) == cache.requests
    assert again == answers[::-1]
    singles = [lm.loglikelihood(instances("loglikelihood", [pair]))[0] for pair in pairs[:3]]
    assert singles == answers[:3]
    assert engine.calls(COMPLETIONS_PATH) < 40  # batched: 8 prompts a request
    cache_client.close()


def test_empty_context_uses_the_prefix_token_or_says_how_to_give_one(engine: FakeEngine) -> None:
    """An empty context conditions on prefix_token_id; without one (the fake adds no BOS) the error names it."""
    lm = LoraSamplerLM(base_url=engine.url, prefix_token_id=2)
    [(logprob, _)] = lm.loglikelihood(instances("loglikelihood", [("", "abc")]))
    with SamplerClient(engine.url) as client:
        assert logprob == pytest.approx(expected_score(client, [2, 4 + 97, 4 + 98, 4 + 99], 1, base_model=engine.model))
    bare = LoraSamplerLM(base_url=engine.url)
    with pytest.raises(ValueError, match="prefix_token_id=<id>"):
        bare.loglikelihood(instances("loglikelihood", [("", "abc")]))
    with pytest.raises(ValueError, match="prefix_token_id"):
        bare.loglikelihood_rolling(instances("loglikelihood_rolling", [("abc",)]))


def test_rolling_windows_are_lm_evals_and_score_every_token_once(engine: FakeEngine) -> None:
    """A text longer than the context: lm-eval's disjoint windows of max_length - 2, each token scored once."""
    text = "The quick brown fox jumps over the lazy dog; " * 4
    lm = LoraSamplerLM(base_url=engine.url, prefix_token_id=1)
    [total, short] = lm.loglikelihood_rolling(instances("loglikelihood_rolling", [(text,), ("Hi.",)]))
    tokens = [4 + b for b in text.encode()]
    windows = list(map(make_disjoint_window, get_rolling_token_windows(tokens, 1, 62, 1)))
    assert len(windows) > 2 and sum(len(cont) for _, cont in windows) == len(tokens)
    with SamplerClient(engine.url) as client:
        expected = sum(expected_score(client, ctx + cont, len(ctx), base_model=engine.model) for ctx, cont in windows)
        expected_short = expected_score(client, [1, 4 + 72, 4 + 105, 4 + 46], 1, base_model=engine.model)
    assert total == pytest.approx(expected, rel=1e-9) and short == pytest.approx(expected_short, rel=1e-9)
    assert math.isfinite(total) and total < short < 0


def test_generate_until_forwards_the_kwargs_and_stops(engine: FakeEngine) -> None:
    """Greedy generations equal the client's own; until, max_gen_toks and vLLM fields reach the request."""
    lm = LoraSamplerLM(base_url=engine.url)
    kwargs = {"until": ["zz"], "max_gen_toks": 5, "do_sample": False, "repetition_penalty": 1.0}
    texts = lm.generate_until(instances("generate_until", [("Q: hi\nA:", kwargs), ("Q: yo\nA:", dict(kwargs))]))
    record = [r for r in engine.requests if r.path == COMPLETIONS_PATH][-1]
    with SamplerClient(engine.url) as client:
        direct = client.sample("Q: hi\nA:", base_model=engine.model, max_tokens=5, temperature=0.0, stop=["zz"])
    assert texts[0] == direct.sequences[0].text and len(texts) == 2
    assert dict(record.extra_fields).get("repetition_penalty") == 1.0


def test_generate_until_refuses_an_unknown_kwarg_by_name(engine: FakeEngine) -> None:
    """A generation kwarg that is not forwarded is an error naming it (with the one meant), before any request."""
    lm = LoraSamplerLM(base_url=engine.url)
    engine.reset_log()
    with pytest.raises(ValueError, match=r"'temprature'.*did you mean 'temperature'"):
        lm.generate_until(instances("generate_until", [("Q", {"until": ["\n"], "temprature": 0.5})]))
    assert engine.calls(COMPLETIONS_PATH) == 0


def test_chat_template_is_the_engines(engine: FakeEngine) -> None:
    """apply_chat_template renders through the engine; add_generation_prompt=False continues the last message."""
    lm = LoraSamplerLM(base_url=engine.url)
    chat = [{"role": "user", "content": "Hi"}]
    assert lm.apply_chat_template(chat) == "<|user|>\nHi\n<|assistant|>\n"
    prefill = [*chat, {"role": "assistant", "content": "Sure"}]
    assert lm.apply_chat_template(prefill, add_generation_prompt=False) == "<|user|>\nHi\n<|assistant|>\nSure"


def test_model_args_refuse_a_key_and_name_an_unknown_one(engine: FakeEngine) -> None:
    """api_key in model_args points to the environment; a mistyped arg names the one meant; harness args pass."""
    with pytest.raises(ValueError, match="LORA_SAMPLER_API_KEY") as refused:
        LoraSamplerLM(base_url=engine.url, api_key="sk-secret")
    assert "sk-secret" not in str(refused.value) and "VLLM_API_KEY" in str(refused.value)
    with pytest.raises(ValueError, match=r"auth_token in model_args .*LORA_SAMPLER_API_KEY"):
        LoraSamplerLM(base_url=engine.url, auth_token="sk-secret")
    with pytest.raises(TypeError, match="did you mean 'num_concurrent'"):
        LoraSamplerLM(base_url=engine.url, num_concurent=4)
    with pytest.raises(ValueError, match="base_url="):
        LoraSamplerLM()
    LoraSamplerLM(base_url=engine.url, batch_size=16, max_batch_size=None, device="cuda")


def test_the_model_args_named_in_errors_are_the_constructors_and_the_guides() -> None:
    """MODEL_ARGS (read from the constructor) is the guide's model_args table, in its order."""
    guide = (Path(__file__).parents[2] / "docs" / "guides" / "lm-eval.md").read_text(encoding="utf-8")
    table = guide.split("`--model_args` takes:", 1)[1].split("\n\n")[1]
    assert tuple(re.findall(r"^\| `(\w+)` \|", table, re.MULTILINE)) == MODEL_ARGS


def test_model_info_names_the_adapter_checkpoint_and_base(engine: FakeEngine, tmp_path: Path, lora_dir: Path) -> None:
    checkpoint = write_adapter_archive(tmp_path / "step-7.tar.gz", engine.model)
    lm = LoraSamplerLM(base_url=engine.url, adapter=checkpoint, lora_base_dir=str(lora_dir))
    info = lm.get_model_info()
    assert info["adapter"].startswith("step-7") and info["checkpoint"].endswith("step-7.tar.gz")
    assert info["base_model"] == engine.model
    assert LoraSamplerLM(base_url=engine.url).get_model_info()["adapter"] is None


def test_tokenizing_rides_the_clients_own_workers(engine: FakeEngine) -> None:
    """The token cache fills through the client's fan-out: with one worker, one /tokenize at a time, each text once."""
    pairs = [(f"Context {i}:", f" continuation {i}") for i in range(24)]
    with SamplerClient(engine.url, max_workers=1) as client:
        lm = LoraSamplerLM(client=client, prefix_token_id=1)
        engine.reset_log()
        lm.loglikelihood(instances("loglikelihood", pairs))
    asked = sorted((r for r in engine.requests if r.path == TOKENIZE_PATH), key=lambda record: record.started)
    assert len(asked) == len({text for pair in pairs for text in (pair[0], pair[0] + pair[1])})
    overlapping = [(a.started, b.started) for a, b in zip(asked, asked[1:]) if b.started < a.finished]
    assert overlapping == []  # before, a pool of its own sent 16 at once whatever the client's max_workers


def test_token_cache_holds_at_most_max_size_and_asks_again_for_what_it_let_go(engine: FakeEngine) -> None:
    """Token ids plus text characters held stay within max_size (least recently used out); a dropped text is asked
    again, a kept one is not."""
    texts = [f"text number {i:03d}" for i in range(50)]  # 15 characters and 15 token ids each: 30 apiece
    with SamplerClient(engine.url) as client:
        cache = TokenCache(client, max_size=300)
        cache.warm(texts)
        assert cache.size() <= 300 and len(cache) == 10 and cache.requests == 50
        assert cache.encode(texts[-1]) == client.tokenize(texts[-1], add_special_tokens=False)  # kept: no request
        assert cache.requests == 50
        cache.encode(texts[0])  # let go: asked again
        assert cache.requests == 51 and cache.size() <= 300
        with pytest.raises(ValueError, match="max_size must be an int >= 1"):
            TokenCache(client, max_size=0)


def test_client_settings_beside_a_client_are_refused_by_name(engine: FakeEngine) -> None:
    """With client=, the client's own settings (num_concurrent sizes its workers) are refused, never ignored."""
    with SamplerClient(engine.url, max_workers=2) as client:
        with pytest.raises(ValueError, match=r"num_concurrent .*not beside client="):
            LoraSamplerLM(client=client, num_concurrent=4)
        with pytest.raises(ValueError, match=r"timeout .*not beside client="):
            LoraSamplerLM(client=client, timeout=5)
        LoraSamplerLM(client=client, prefix_token_id=1)
    with pytest.raises(ValueError, match="num_concurrent must be an int >= 1"):
        LoraSamplerLM(base_url=engine.url, num_concurrent=0)


def test_a_local_tokenizer_scores_the_same_with_one_tokenize_request(engine: FakeEngine, tmp_path: Path) -> None:
    """tokenizer=<the model's folder> (or a tokenizer object): the same answers; the engine tokenizes one text, the
    check that the two tokenizers agree."""
    pairs = [(f"Question {i % 5}: é", f" answer {i}") for i in range(20)]
    folder = write_byte_tokenizer(tmp_path / "model")
    with SamplerClient(engine.url) as client:
        remote = LoraSamplerLM(client=client).loglikelihood(instances("loglikelihood", pairs))
        engine.reset_log()
        local_lm = LoraSamplerLM(client=client, tokenizer=str(folder))
        local = local_lm.loglikelihood(instances("loglikelihood", pairs))
        assert engine.calls(TOKENIZE_PATH) == 1 == local_lm.tokens.requests
        by_file = LoraSamplerLM(client=client, tokenizer=str(folder / "tokenizer.json"))
        by_object = LoraSamplerLM(client=client, token_cache=TokenCache(client, tokenizer=ByteTokenizer()))
        assert by_file.loglikelihood(instances("loglikelihood", pairs)) == local
        assert by_object.loglikelihood(instances("loglikelihood", pairs)) == local
    assert local == remote


def test_a_tokenizer_of_another_model_is_refused_and_bad_ones_named(engine: FakeEngine, tmp_path: Path) -> None:
    """Ids that differ from the engine's fail before any scoring request; a path with no tokenizer.json, a file the
    tokenizers package cannot read and a non-tokenizer each get their own message."""
    other = LoraSamplerLM(base_url=engine.url, tokenizer=str(write_byte_tokenizer(tmp_path / "other", shift=1)))
    engine.reset_log()
    with pytest.raises(ValueError, match=r"is not the engine's: it makes .* where the engine's makes"):
        other.loglikelihood(instances("loglikelihood", [("a b", " c")]))
    assert engine.calls(COMPLETIONS_PATH) == 0
    (tmp_path / "junk.json").write_text("{}", encoding="utf-8")
    for bad, error, words in (
        (tmp_path / "none", ValueError, "no tokenizer.json there"),
        (tmp_path / "junk.json", ValueError, "cannot read"),
        (42, TypeError, "with encode"),
    ):
        with pytest.raises(error, match=words):
            LoraSamplerLM(base_url=engine.url, tokenizer=bad)  # type: ignore[arg-type]
    with SamplerClient(engine.url) as client, pytest.raises(ValueError, match="beside token_cache"):
        LoraSamplerLM(client=client, token_cache=TokenCache(client), tokenizer=str(tmp_path / "other"))
