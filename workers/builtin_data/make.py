"""Regenerate mortal's built-in datasets (`builtin:arith`, `builtin:wordproblems`, `builtin:mbpp-mini`).

    python workers/builtin_data/make.py          # rewrites every <name>.jsonl here

Who uses the files: mortal.workers.data (`dataset.name: builtin:NAME`). Every row has a chat
`prompt` ([{"role": "user", ...}]); arith and word problems have a numeric `answer` (a string, as
GSM8K keeps it), word problems also a worked `solution` ending in "#### <answer>"; mbpp-mini rows
(tasks in mbpp_mini_tasks.py) have `tests` (assert strings, run by `env: code-execution`) and a
reference `solution` that passes them. The same seed always writes
the same bytes (tests/workers/test_data.py checks), so the files are reviewable and never drift.
Not imported by the package: it is a developer's script.
"""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAMES = [
    "Ada",
    "Ben",
    "Chen",
    "Dara",
    "Eli",
    "Fatima",
    "Goran",
    "Hana",
    "Ivan",
    "Jun",
    "Kemi",
    "Luca",
    "Mina",
    "Noor",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sami",
    "Tara",
]


def arith_rows(n: int = 2000, seed: int = 0) -> list[dict]:
    """'What is a + b?' with a, b in 1..20: the anchor's CPU learning task (tests/anchors trl_cpu_learn)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        question = f"What is {a} + {b}? Reply with only the number."
        rows.append({"prompt": [{"role": "user", "content": question}], "answer": str(a + b)})
    return rows


# Each template draws its numbers and returns (question, steps, answer); steps become the solution.
Problem = tuple[str, list[str], int]


def _apples(rng: random.Random, who: str) -> Problem:
    have, bought, ate = rng.randint(3, 20), rng.randint(2, 15), rng.randint(1, 5)
    q = f"{who} has {have} apples, buys {bought} more, then eats {ate}. How many apples does {who} have now?"
    return (
        q,
        [f"{have} + {bought} = {have + bought}", f"{have + bought} - {ate} = {have + bought - ate}"],
        (have + bought - ate),
    )


def _boxes(rng: random.Random, who: str) -> Problem:
    boxes, per, given = rng.randint(2, 9), rng.randint(3, 12), rng.randint(1, 10)
    total = boxes * per
    q = (
        f"{who} packs {boxes} boxes with {per} pencils each and gives away {given} pencils. "
        f"How many pencils are left?"
    )
    return q, [f"{boxes} * {per} = {total}", f"{total} - {given} = {total - given}"], total - given


def _wage(rng: random.Random, who: str) -> Problem:
    rate, hours, days = rng.randint(8, 25), rng.randint(2, 8), rng.randint(2, 6)
    daily = rate * hours
    q = (
        f"{who} earns ${rate} an hour and works {hours} hours a day for {days} days. "
        "How many dollars is that?"
    )

    return q, [f"{rate} * {hours} = {daily}", f"{daily} * {days} = {daily * days}"], daily * days


def _share(rng: random.Random, who: str) -> Problem:
    friends, each = rng.randint(3, 8), rng.randint(2, 9)
    extra = rng.randint(1, friends - 1)  # a true remainder: fewer than one more round
    total = friends * each + extra
    q = (
        f"{who} has {total} stickers, shares them equally among {friends} friends and keeps the {extra} "
        f"left over. How many stickers does each friend get?"
    )
    return q, [f"{total} - {extra} = {total - extra}", f"{total - extra} / {friends} = {each}"], each


def _trip(rng: random.Random, who: str) -> Problem:
    speed, hours, back = rng.randint(20, 70), rng.randint(2, 5), rng.randint(10, 40)
    out = speed * hours
    q = (
        f"{who} drives {hours} hours at {speed} km per hour, then drives {back} km back toward home. "
        f"How far from home is {who} now, in km?"
    )
    return q, [f"{speed} * {hours} = {out}", f"{out} - {back} = {out - back}"], out - back


def _shop(rng: random.Random, who: str) -> Problem:
    shirts, price, socks, sock_price = (
        rng.randint(1, 5),
        rng.randint(8, 30),
        rng.randint(1, 6),
        rng.randint(2, 6),
    )
    a, b = shirts * price, socks * sock_price
    q = (
        f"{who} buys {shirts} shirts at ${price} each and {socks} pairs of socks at ${sock_price} each. "
        f"How many dollars does {who} spend?"
    )
    return q, [f"{shirts} * {price} = {a}", f"{socks} * {sock_price} = {b}", f"{a} + {b} = {a + b}"], a + b


def _garden(rng: random.Random, who: str) -> Problem:
    rows, per, dead = rng.randint(2, 10), rng.randint(4, 15), rng.randint(1, 9)
    total = rows * per
    q = f"{who} plants {rows} rows of {per} tulips. {dead} tulips do not grow. How many tulips grow?"
    return q, [f"{rows} * {per} = {total}", f"{total} - {dead} = {total - dead}"], total - dead


def _savings(rng: random.Random, who: str) -> Problem:
    start, weekly, weeks, spent = (
        rng.randint(5, 50),
        rng.randint(3, 20),
        rng.randint(2, 8),
        rng.randint(1, 30),
    )
    saved = weekly * weeks
    end = start + saved - spent
    q = (
        f"{who} has ${start}, saves ${weekly} every week for {weeks} weeks, then spends ${spent} on a book. "
        f"How many dollars does {who} have?"
    )
    return (
        q,
        [
            f"{weekly} * {weeks} = {saved}",
            f"{start} + {saved} = {start + saved}",
            f"{start + saved} - {spent} = {end}",
        ],
        end,
    )


def _pages(rng: random.Random, who: str) -> Problem:
    per_day, days = rng.randint(5, 30), rng.randint(2, 7)
    left = rng.randint(10, 90)
    total = per_day * days + left
    q = (
        f"A book has {total} pages. {who} reads {per_day} pages a day for {days} days. "
        f"How many pages are left?"
    )
    return q, [f"{per_day} * {days} = {per_day * days}", f"{total} - {per_day * days} = {left}"], left


def _eggs(rng: random.Random, who: str) -> Problem:
    hens, eggs, sold = rng.randint(2, 12), rng.randint(1, 3), rng.randint(1, 6)
    laid = hens * eggs * 7
    sold = min(sold * 5, laid)
    q = (
        f"{who}'s {hens} hens each lay {eggs} eggs a day. In one week {who} sells {sold} eggs. "
        f"How many eggs are left at the end of the week?"
    )
    return q, [f"{hens} * {eggs} * 7 = {laid}", f"{laid} - {sold} = {laid - sold}"], laid - sold


TEMPLATES: list[Callable[[random.Random, str], Problem]] = [
    _apples,
    _boxes,
    _wage,
    _share,
    _trip,
    _shop,
    _garden,
    _savings,
    _pages,
    _eggs,
]
WORDPROBLEM_INSTRUCTION = "Solve the problem. End with the final answer on its own line as '#### <number>'."


def wordproblem_rows(per_template: int = 30, seed: int = 0) -> list[dict]:
    """GSM8K-style multi-step problems: `answer` is the number, `solution` the steps + '#### n'."""
    rng = random.Random(seed)
    rows = []
    for i in range(per_template):
        for template in TEMPLATES:
            who = NAMES[(i + rng.randint(0, len(NAMES) - 1)) % len(NAMES)]
            question, steps, answer = template(rng, who)
            rows.append(
                {
                    "prompt": [{"role": "user", "content": f"{question}\n{WORDPROBLEM_INSTRUCTION}"}],
                    "answer": str(answer),
                    "solution": "\n".join([*steps, f"#### {answer}"]),
                }
            )
    return rows


MBPP_INSTRUCTION = "Write a Python function such that {task}\nYour code should pass this test:\n{example}"


def mbpp_mini_rows() -> list[dict]:
    """Small Python tasks with assert tests (mbpp_mini_tasks.py, loaded by path: this is a script)."""
    spec = importlib.util.spec_from_file_location("mbpp_mini_tasks", HERE / "mbpp_mini_tasks.py")
    tasks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tasks)
    return [
        {
            "prompt": [{"role": "user", "content": MBPP_INSTRUCTION.format(task=task, example=tests[0])}],
            "tests": tests,
            "solution": solution,
        }
        for task, solution, tests in tasks.TASKS
    ]


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


BUILDERS: dict[str, Callable[[], list[dict]]] = {
    "arith": arith_rows,
    "wordproblems": wordproblem_rows,
    "mbpp-mini": mbpp_mini_rows,
}


def main() -> None:
    for name, build in BUILDERS.items():
        (HERE / f"{name}.jsonl").write_text(render(build()))
        print(f"wrote {HERE / f'{name}.jsonl'}")


if __name__ == "__main__":
    main()
