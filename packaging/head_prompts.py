"""The training prompts of the embedded default's EAGLE-3 head (``specchat train-head --prompts``).

Never the evaluation prompts: the bench's chat family is Spec-Bench's MT-bench questions (ids 81-160), which
are left out here. What goes in, deterministically (a fixed seed):

- Spec-Bench's other categories (translation, summarization, qa, math_reasoning, rag: ids 161-560, first turns),
  from ``backend/bench/data/spec_bench.jsonl`` (Apache-2.0, see its notice);
- prompts written for this file in MT-bench's eight categories (writing, roleplay, reasoning, math, coding,
  extraction, stem, humanities), from templates over hand-written topics: none is an MT-bench question.

    python packaging/head_prompts.py OUT.jsonl [--eval OUT_EVAL.jsonl]

``--eval`` also writes held-out chat prompts for the acceptance report: MT-bench-style prompts from the same
templates with topics the training set does not use.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPEC_BENCH = Path(__file__).resolve().parent.parent / "backend" / "bench" / "data" / "spec_bench.jsonl"
MT_BENCH_IDS = range(81, 161)

WRITING_FORMS = [
    "a short poem",
    "a limerick",
    "three haiku",
    "a product description",
    "a cover letter",
    "the introduction of a blog post",
    "a persuasive paragraph",
    "the opening of a short story",
    "a restaurant review",
    "a toast for a wedding",
    "a newsletter announcement",
    "a thank-you note",
    "an apology email to a customer",
    "a motivational message",
    "a movie synopsis",
    "a diary entry",
    "a job advertisement",
    "a children's bedtime story",
    "a press release",
    "a social media post",
]
WRITING_TOPICS = [
    "autumn in a small town",
    "a new electric bicycle",
    "learning to cook at forty",
    "a lost cat that finds its way home",
    "working from home",
    "the first day at a new school",
    "a lighthouse keeper",
    "saving water at home",
    "a jazz festival by the sea",
    "hiking in the mountains",
    "a neighbourhood library",
    "a rainy Sunday afternoon",
    "an old family recipe",
    "a robot that wants to be a gardener",
    "a community vegetable garden",
    "the night before an exam",
    "a small bakery opening",
    "moving to a new country",
    "a solar-powered boat",
    "a friendship between two neighbours",
    "a winter market",
    "a museum of forgotten inventions",
    "a marathon runner's last mile",
    "a village without internet",
]
HELD_OUT_TOPICS = [
    "a train journey through the desert",
    "a dog who learns to surf",
    "a city after a snowstorm",
    "the last day of summer camp",
    "a forgotten violin in an attic",
    "a recycling program at an office",
]
PERSONAS = [
    "a medieval blacksmith",
    "the captain of a cargo ship",
    "a tour guide in Rome",
    "a personal fitness trainer",
    "a detective in 1920s London",
    "a museum curator",
    "a head chef in a busy restaurant",
    "the commander of a space station",
    "a kindergarten teacher",
    "a retired pirate",
    "a park ranger",
    "a wedding planner",
    "a librarian who loves mysteries",
    "a mountain guide",
    "a street musician",
    "a veterinarian",
]
ROLE_TASKS = [
    "Introduce yourself to a newcomer and describe a typical day.",
    "Give advice to a young person who wants to follow your path.",
    "Describe the hardest challenge you have faced and how you dealt with it.",
    "Explain the three most important rules of your work.",
    "Tell a visitor about the most memorable thing that happened to you.",
]
REASONING = [
    "{a} is older than {b}, and {b} is older than {c}. Who is the youngest? Explain your reasoning.",
    "If today is {day}, what day of the week will it be in {n} days? Show your steps.",
    "A box contains {r} red balls and {g} green balls. If you take out two balls without looking, what is the "
    "probability that both are red? Explain.",
    "There are {n} people in a room and each shakes hands with every other person exactly once. How many "
    "handshakes are there? Explain your reasoning.",
    "{a} says: 'I always lie.' Can this statement be true? Explain the paradox.",
    "A snail climbs {u} metres up a wall each day and slides down {d} metres each night. The wall is {h} metres "
    "high. On which day does the snail reach the top? Explain.",
    "If all bloops are razzies and some razzies are lazzies, must some bloops be lazzies? Explain.",
    "{a}, {b} and {c} each own a different pet: a cat, a dog and a parrot. {a} does not own the dog, and {c} owns "
    "the parrot. Who owns which pet? Explain.",
]
NAMES = ["Alice", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kofi", "Lena"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MATH = [
    "A shop sells notebooks for ${p} each. How much do {n} notebooks cost, and how much change do you get from ${m}?",
    "Solve for x: {a}x + {b} = {c}. Show each step.",
    "What is the area and the perimeter of a rectangle {a} cm long and {b} cm wide?",
    "Find the sum of the integers from 1 to {n}. Explain the method.",
    "A train travels {d} km in {h} hours. What is its average speed, and how long would it take to travel {e} km "
    "at that speed?",
    "What is {p}% of {m}? Then increase the result by {q}%.",
    "Simplify the fraction {a}/{c} and write it as a decimal.",
    "A recipe for {n} people needs {g} grams of flour. How much flour is needed for {m} people?",
    "Compute the mean and the median of these numbers: {list}.",
    "A rectangle's length is {a} more than its width and its perimeter is {c}. Find its dimensions.",
]
CODE_TASKS = [
    "reverses the words of a sentence",
    "checks whether a string is a palindrome, ignoring case and spaces",
    "counts the vowels in a string",
    "merges two sorted lists into one sorted list",
    "returns the n-th Fibonacci number iteratively",
    "finds the duplicate values in a list",
    "flattens a nested list of any depth",
    "computes the factorial of a number without recursion",
    "performs a binary search on a sorted list",
    "removes duplicate characters from a string while keeping their order",
    "converts a temperature from Celsius to Fahrenheit and back",
    "checks whether a number is prime",
    "counts how often each word appears in a text",
    "rotates a list by k positions",
    "returns the second largest number of a list",
    "validates an email address with a simple rule",
    "computes the greatest common divisor of two numbers",
    "groups a list of words by their first letter",
    "transposes a matrix given as a list of lists",
    "parses a date string in the format YYYY-MM-DD",
]
LANGUAGES = ["Python", "JavaScript", "Go", "Rust", "C", "Java", "TypeScript"]
SNIPPETS = [
    "def f(xs):\n    out = []\n    for x in xs:\n        if x % 2 == 0:\n            out.append(x * x)\n    return out",
    "function g(s) {\n  return s.split('').reverse().join('') === s;\n}",
    "def total(items):\n    t = 0\n    for i in range(len(items)):\n        t += items[i]['price'] * items[i]['qty']\n"
    "    return t",
    "SELECT name, COUNT(*) AS n FROM orders GROUP BY name HAVING COUNT(*) > 3 ORDER BY n DESC;",
    "def avg(nums):\n    return sum(nums) / len(nums)",
    "for (int i = 0; i <= n; i++) {\n    sum += a[i];\n}",
    "def read_config(path):\n    f = open(path)\n    data = f.read()\n    return data.split('\\n')",
]
CODE_ASKS = [
    "Explain what this code does, line by line:",
    "Find the bug or weakness in this code and fix it:",
    "Rewrite this code to be clearer and add comments:",
    "Write unit tests for this code:",
]
EXTRACTION_TEXTS = [
    "On March 3, 2021, Maria Lopez paid $45.20 for two tickets to the Berlin Philharmonic. Her brother Tom joined "
    "her on April 9 and spent $18.75 on dinner at Cafe Luna.",
    "The meeting between Orion Ltd and Baxter Foods is scheduled for 10 June 2024 at 14:30 in Oslo. Attendees: "
    "Sven Olsen (CEO), Priya Nair (CFO) and Mark Evans (legal).",
    "Invoice 2291: 3 chairs at 49.99 EUR, 1 table at 219.00 EUR, delivery 25.00 EUR. Customer: Hannah Schmidt, "
    "Lindenstrasse 4, Munich. Due date: 30 September.",
    "Flight AZ 611 leaves Rome at 09:15 and lands in New York at 12:40 local time. Flight UA 880 leaves New York "
    "at 18:05 and arrives in Chicago at 19:55.",
    "In 1869 the Suez Canal opened; in 1914 the Panama Canal followed. The Kiel Canal, finished in 1895, links "
    "the North Sea and the Baltic.",
]
EXTRACTION_ASKS = [
    "List every person, place and date mentioned in this text:",
    "Extract all amounts of money and what they were for, as a table:",
    "Turn this text into a JSON object with the key facts:",
    "Write the facts of this text as a bullet list, one fact per line:",
]
STEM_CONCEPTS = [
    "photosynthesis",
    "black holes",
    "how vaccines train the immune system",
    "DNA replication",
    "plate tectonics",
    "Ohm's law",
    "entropy",
    "how a neural network learns",
    "the greenhouse effect",
    "how a refrigerator works",
    "the water cycle",
    "nuclear fission",
    "the speed of light",
    "antibiotic resistance",
    "how GPS finds your position",
    "compound interest",
    "the Doppler effect",
    "how batteries store energy",
    "why the sky is blue",
    "how bridges carry heavy loads",
]
STEM_ASKS = [
    "Explain {c} in simple terms for a 12-year-old.",
    "Explain {c} to a university student, with one worked example.",
    "What are common misconceptions about {c}?",
]
HUMANITIES = [
    "What were the main causes of the French Revolution?",
    "How did the printing press change European society?",
    "Summarize the main ideas of Stoic philosophy.",
    "Why did the Roman Empire split into east and west?",
    "How did the Silk Road influence trade and culture?",
    "What is the difference between a democracy and a republic?",
    "How did the Industrial Revolution change family life?",
    "What can we learn from the fall of the Maya cities?",
    "Explain the idea of the social contract in political philosophy.",
    "How has social media changed political campaigns?",
    "Why is the Renaissance considered a turning point in art?",
    "What role did women play in the Second World War?",
    "Compare the economic ideas of Adam Smith and John Maynard Keynes.",
    "How do languages change over time?",
    "What are the arguments for and against a universal basic income?",
    "How did the invention of writing change human societies?",
    "Describe the main features of Gothic architecture.",
    "Why do historians disagree about the causes of the First World War?",
    "What is cultural relativism, and what are its limits?",
    "How did the Meiji Restoration transform Japan?",
]


def _fill(template: str, rng: random.Random) -> str:
    a, b, c = rng.sample(NAMES, 3)
    values = {
        "a": a,
        "b": b,
        "c": c,
        "day": rng.choice(DAYS),
        "n": rng.randint(5, 60),
        "r": rng.randint(2, 9),
        "g": rng.randint(2, 9),
        "u": rng.randint(3, 6),
        "d": rng.randint(1, 2),
        "h": rng.randint(10, 30),
    }
    return template.format(**values)


def _fill_math(template: str, rng: random.Random) -> str:
    nums = sorted(rng.sample(range(2, 99), 7))
    rng.shuffle(nums)
    return template.format(
        p=rng.randint(2, 15),
        n=rng.randint(3, 40),
        m=rng.choice([50, 100, 200, 250, 500, 1000]),
        a=rng.randint(2, 19),
        b=rng.randint(1, 40),
        c=rng.randint(41, 200),
        d=rng.randint(120, 900),
        h=rng.randint(2, 9),
        e=rng.randint(100, 1500),
        q=rng.choice([5, 10, 15, 20, 25]),
        g=rng.choice([200, 250, 300, 450, 500]),
        list=", ".join(map(str, nums)),
    )


def written_prompts(rng: random.Random, topics: list[str]) -> list[tuple[str, str]]:
    """(category, prompt) pairs from the templates; ``topics`` are the writing topics to draw from."""
    out: list[tuple[str, str]] = []
    for _ in range(50):
        out.append(("writing", f"Write {rng.choice(WRITING_FORMS)} about {rng.choice(topics)}."))
    for persona in PERSONAS:
        for task in rng.sample(ROLE_TASKS, 3):
            out.append(("roleplay", f"Pretend you are {persona}. {task}"))
    for template in REASONING:
        for _ in range(5):
            out.append(("reasoning", _fill(template, rng)))
    for template in MATH:
        for _ in range(5):
            out.append(("math", _fill_math(template, rng)))
    for task in CODE_TASKS:
        for language in rng.sample(LANGUAGES, 2):
            out.append(("coding", f"Write a {language} function that {task}. Explain how it works."))
    for snippet in SNIPPETS:
        for ask in CODE_ASKS:
            out.append(("coding", f"{ask}\n\n```\n{snippet}\n```"))
    for text in EXTRACTION_TEXTS:
        for ask in EXTRACTION_ASKS:
            out.append(("extraction", f"{ask}\n\n{text}"))
    for concept in STEM_CONCEPTS:
        for ask in rng.sample(STEM_ASKS, 2):
            out.append(("stem", ask.format(c=concept)))
    for question in HUMANITIES:
        out.append(("humanities", question))
        out.append(("humanities", question + " Answer in three short paragraphs."))
    return out


def spec_bench_prompts() -> list[tuple[str, str]]:
    out = []
    for line in SPEC_BENCH.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if row["question_id"] in MT_BENCH_IDS:
            continue  # the bench's chat family: held out
        out.append((row["category"], row["turns"][0]))
    return out


def _write(path: Path, rows: list[tuple[str, str]], prefix: str) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for i, (category, text) in enumerate(rows):
            item = {"id": f"{prefix}-{category}-{i}", "messages": [{"role": "user", "content": text}]}
            handle.write(json.dumps(item, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--eval", type=Path, default=None, help="also write held-out chat prompts here")
    args = parser.parse_args()
    rng = random.Random(20240601)
    rows = spec_bench_prompts() + written_prompts(rng, WRITING_TOPICS)
    rng.shuffle(rows)
    _write(args.out, rows, "train")
    print(f"{len(rows)} training prompts -> {args.out}")
    if args.eval is not None:
        held = [("writing", f"Write {rng.choice(WRITING_FORMS)} about {t}.") for t in HELD_OUT_TOPICS]
        held += [("stem", "Explain how a solar panel turns light into electricity.")]
        held += [("humanities", "What were the consequences of the Black Death for European workers?")]
        held += [("roleplay", "Pretend you are a lighthouse cook. Describe your kitchen and a storm night.")]
        held += [("coding", "Write a Python function that checks whether two strings are anagrams.")]
        _write(args.eval, held, "eval")
        print(f"{len(held)} held-out prompts -> {args.eval}")


if __name__ == "__main__":
    main()
