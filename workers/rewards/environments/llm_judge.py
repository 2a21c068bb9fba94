"""`env: llm-judge`: a model behind an OpenAI-compatible /chat/completions endpoint grades each completion.

    from mortal.rewards.examples import LLMJudgeEnvironment
    judge = LLMJudgeEnvironment(model="gpt-4o-mini", score_range=(0, 10))   # reads $OPENAI_API_KEY

Who calls it: RewardSet (a spec's `env: llm-judge` with `model`, `baseURL`, `apiKeyEnv`, and `args`
for the rest), or TRL directly. For each completion it fills `prompt_template` ({prompt},
{completion}, {low}, {high} and any dataset column by name), asks the judge (temperature 0 by
default, `max_concurrency` requests at a time), reads a number from the reply ("7", "7/10",
"Score: 7", "7 out of 10") and maps [low, high] onto [0, 1]. A reply with no usable number, or one
outside the range, scores None (TRL's "not applicable"). HTTP goes through urllib: httpx is not a
dependency of mortal, and one JSON POST needs nothing more. Retries (429, 5xx, timeouts, refused
connections) use tenacity with exponential backoff; when they run out the completion scores None,
is not cached, and `llm_judge/errors` counts it, so a judge outage slows learning without failing
the run. A refused key (401/403) or a wrong model/URL (404) fails the run at once: retrying cannot fix it.
The API key is read from the environment variable `api_key_env` (list it in spec.secrets); the key
itself never appears in a spec, a log line or the cache.
"""

from __future__ import annotations

import json
import logging
import os
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential

from mortal.workers.errors import FatalWorkerError
from mortal.workers.rewards.environments.base import BuiltinEnvironment, Item, Log, Outcome

log = logging.getLogger("mortal.rewards.judge")
DEFAULT_BASE_URL = "https://api.openai.com/v1"
DEFAULT_TEMPLATE = (
    "You are grading a response to a task.\n\n"
    "Task:\n{prompt}\n\n"
    "Response:\n{completion}\n\n"
    "Rate the response from {low} to {high}, where {high} is the best. Reply with only the number."
)
NUM = r"-?\d+(?:\.\d+)?"
ONLY_NUMBER = re.compile(rf"\s*\**\s*({NUM})\s*\**\s*(?:(?:/|out of)\s*{NUM})?\s*\.?\s*", re.I)
LABELLED = re.compile(rf"(?:score|rating|grade)\s*(?:is|of|=|:)?\s*\**\s*({NUM})", re.I)
OUT_OF = re.compile(rf"({NUM})\s*(?:/|out of)\s*{NUM}", re.I)
THINKING = re.compile(r"<think>.*?</think>", re.S | re.I)
TRANSIENT_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class TransientJudgeError(Exception):
    """A failure another attempt may not have (rate limit, 5xx, timeout, refused connection)."""


def parse_score(reply: str) -> float | None:
    """The number a judge answered with, or None when the reply holds no unambiguous number."""
    text = THINKING.sub("", reply).strip()
    match = ONLY_NUMBER.fullmatch(text)
    if match:
        return float(match.group(1))
    for pattern in (LABELLED, OUT_OF):
        found = pattern.findall(text)
        if found:
            return float(found[-1])
    numbers = re.findall(NUM, text)
    return float(numbers[0]) if len(numbers) == 1 else None


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, TransientJudgeError)


class _Defaults(dict):
    """format_map that leaves unknown {fields} as they are (a template may show braces)."""

    def __missing__(self, key: str) -> str:
        return "{" + key + "}"


class LLMJudgeEnvironment(BuiltinEnvironment):
    """Score = the judge's grade, normalized into [0, 1] (see the module docstring)."""

    ENV = "llm-judge"
    name = "llm_judge"
    SPEC_ARGS: ClassVar[tuple[str, ...]] = (
        "score_range",
        "prompt_template",
        "system_prompt",
        "temperature",
        "max_tokens",
        "timeout",
        "max_retries",
        "retry_wait",
        "max_concurrency",
        *BuiltinEnvironment.SPEC_ARGS,
    )

    def __init__(
        self,
        model: str,
        base_url: str | None = None,
        api_key_env: str | None = "OPENAI_API_KEY",
        score_range: tuple[float, float] = (0, 10),
        prompt_template: str = DEFAULT_TEMPLATE,
        system_prompt: str | None = None,
        temperature: float = 0.0,
        max_tokens: int | None = None,
        timeout: float = 60.0,
        max_retries: int = 4,
        retry_wait: float = 1.0,
        max_concurrency: int = 8,
        cache: str | None = None,
        cache_size: int = 4096,
        cache_path: str | None = None,
    ) -> None:
        super().__init__(cache, cache_size, cache_path)
        low, high = (float(x) for x in score_range)
        if not high > low:
            raise ValueError(f"score_range must be (low, high) with high > low (got {score_range!r})")
        self.model, self.base_url, self.api_key_env = model, base_url, api_key_env
        self.score_range = tuple(score_range)
        self.prompt_template, self.system_prompt = prompt_template, system_prompt
        self.temperature, self.max_tokens, self.timeout = temperature, max_tokens, timeout
        self.max_retries, self.retry_wait, self.max_concurrency = max_retries, retry_wait, max_concurrency
        self._low, self._high = low, high
        self._url = (base_url or DEFAULT_BASE_URL).rstrip("/") + "/chat/completions"

    def _api_key(self) -> str | None:
        """Read at each request, not at construction: building the environment (MortalTrainer) needs no
        secret."""
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise FatalWorkerError(
                "RewardSecretMissing",
                f"llm-judge: environment variable {self.api_key_env} (the judge's API key, api_key_env) is "
                "not set in this worker; export it where the controller runs and list "
                f"{self.api_key_env} in spec.secrets",
            )
        return key

    def settings(self) -> dict[str, Any]:
        return {
            **super().settings(),
            "model": self.model,
            "url": self._url,
            "range": [self._low, self._high],
            "template": self.prompt_template,
            "system": self.system_prompt,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }

    def spec_entry(self) -> dict[str, Any] | None:
        entry = super().spec_entry()
        if entry is not None:
            entry["model"] = self.model
            if self.base_url is not None:
                entry["base_url"] = self.base_url
            if self.api_key_env is not None:
                entry["api_key_env"] = self.api_key_env
            if "score_range" in entry.get("args", {}):
                entry["args"]["score_range"] = list(self.score_range)
        return entry

    # -- one request -------------------------------------------------------------------------------
    def _messages(self, item: Item) -> list[dict[str, str]]:
        fields = _Defaults(
            {
                **{k: str(v) for k, v in item.row.items()},
                "prompt": item.prompt,
                "completion": item.completion,
                "low": f"{self._low:g}",
                "high": f"{self._high:g}",
            }
        )
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*messages, {"role": "user", "content": self.prompt_template.format_map(fields)}]

    def _post(self, body: bytes) -> dict[str, Any]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        key = self._api_key()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(self._url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read().decode("utf-8"))
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode("utf-8", errors="replace")[:300]
            if exc.code in TRANSIENT_STATUS:
                raise TransientJudgeError(f"HTTP {exc.code}: {detail}") from exc
            if exc.code in (401, 403):
                raise FatalWorkerError(
                    "RewardJudgeRefused",
                    f"llm-judge: {self._url} refused the API key from "
                    f"{self.api_key_env} (HTTP {exc.code}): {detail}",
                ) from exc
            if exc.code == 404:
                raise FatalWorkerError(
                    "RewardJudgeNotFound",
                    f"llm-judge: {self._url} answered 404 for model "
                    f"{self.model!r}: check baseURL and model ({detail})",
                ) from exc
            raise RuntimeError(f"HTTP {exc.code}: {detail}") from exc
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            raise TransientJudgeError(f"{type(exc).__name__}: {exc}") from exc
        except json.JSONDecodeError as exc:
            raise TransientJudgeError(f"the reply is not JSON: {exc}") from exc

    def ask(self, item: Item) -> str:
        """The judge's reply text for one item (retried on transient failures)."""
        payload: dict[str, Any] = {
            "model": self.model,
            "messages": self._messages(item),
            "temperature": self.temperature,
        }
        if self.max_tokens is not None:
            payload["max_tokens"] = self.max_tokens
        body = json.dumps(payload).encode("utf-8")
        retrying = Retrying(
            stop=stop_after_attempt(self.max_retries + 1),
            reraise=True,
            wait=wait_exponential(multiplier=self.retry_wait, max=30),
            retry=retry_if_exception(_transient),
        )
        reply = retrying(self._post, body)
        try:
            return str(reply["choices"][0]["message"]["content"] or "")
        except (KeyError, IndexError, TypeError) as exc:
            raise RuntimeError(f"unexpected reply shape: {str(reply)[:200]}") from exc

    def _grade(self, item: Item) -> Outcome:
        try:
            reply = self.ask(item)
        except FatalWorkerError:
            raise
        except (TransientJudgeError, RuntimeError) as exc:
            log.warning("llm-judge %s: no grade (%s); this completion scores None", self.model, exc)
            return Outcome(None, cacheable=False)
        value = parse_score(reply)
        if value is None or not self._low <= value <= self._high:
            return Outcome(None)
        return Outcome((value - self._low) / (self._high - self._low))

    def score_items(self, items: list[Item], log: Log) -> list[Outcome]:
        with ThreadPoolExecutor(max(1, min(self.max_concurrency, len(items))), "mortal-judge") as pool:
            outcomes = list(pool.map(self._grade, items))
        log(f"{self.name}/errors", float(sum(not o.cacheable for o in outcomes)))
        log(f"{self.name}/requests", float(len(items)))
        return outcomes
