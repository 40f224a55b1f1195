"""The teacher's prompts: a self-instruct style grid of topics × task types, made here, seeded.

Drafts must agree with the target on the chat traffic it serves, so the teacher data is the
target's own answers to many different requests: questions, explanations, code, maths,
summaries, rewriting, lists and stories, over topics from science to cooking. Every prompt is
built from small tables by a seeded generator, so the set is the same on every machine and
nothing is downloaded.

Held-out prompts never enter training: a whole *topic* (and its code and maths items) is either
held out or not, chosen by a hash of its name, so no held-out prompt has a training twin that
differs only in its phrasing.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

TOPICS = (
    "photosynthesis", "black holes", "the water cycle", "volcanoes", "the human heart", "vaccines", "plate tectonics",
    "the moon landing", "the Roman Empire", "the French Revolution", "the printing press", "ancient Egypt",
    "the Silk Road", "the Industrial Revolution", "the Renaissance", "World War I", "the Cold War", "democracy",
    "inflation", "interest rates", "supply and demand", "the stock market", "cryptocurrency", "renewable energy",
    "solar panels", "wind turbines", "electric cars", "climate change", "recycling", "ocean currents", "coral reefs",
    "rainforests", "deserts", "bees", "dolphins", "elephants", "wolves", "octopuses", "penguins", "dinosaurs",
    "evolution", "DNA", "the immune system", "sleep", "nutrition", "exercise", "meditation", "stress", "memory",
    "learning a language", "music theory", "jazz", "the guitar", "the piano", "painting", "photography",
    "architecture", "bridges", "skyscrapers", "trains", "airplanes", "rockets", "satellites", "the internet",
    "email", "passwords", "encryption", "databases", "machine learning", "neural networks", "robots",
    "video games", "chess", "football", "basketball", "the Olympic Games", "marathon running", "swimming",
    "cooking pasta", "baking bread", "coffee", "tea", "chocolate", "gardening", "houseplants", "composting",
    "camping", "hiking", "travel on a budget", "time management", "job interviews", "public speaking",
    "writing a resume", "saving money", "budgeting", "starting a small business", "customer service",
    "teamwork", "leadership", "friendship", "kindness", "honesty", "libraries", "poetry", "Shakespeare",
    "fairy tales", "mythology", "the solar system", "Mars", "stars", "gravity", "magnets", "electricity",
    "light", "sound", "atoms", "chemical reactions", "the periodic table", "water", "weather", "rain", "snow",
    "earthquakes", "mountains", "rivers", "islands", "maps", "languages of the world", "cities", "villages",
    "farming", "fishing", "forests", "birds", "cats", "dogs", "horses", "insects", "spiders", "mushrooms",
    "the brain", "eyes", "teeth", "bones", "first aid", "hospitals", "nurses", "teachers", "schools",
    "universities", "online learning", "smartphones", "social media", "artificial intelligence", "open source",
    "Python programming", "the Linux operating system", "cloud computing", "3D printing", "electric bicycles",
    "public transport", "urban parks", "museums", "theatre", "movies", "animation", "comics", "board games",
)

TASKS = {
    "question": (
        "What is {t}?", "Can you tell me about {t}?", "Why is {t} important?", "How does {t} work?",
        "What are the main facts everyone should know about {t}?", "What is the history of {t}?",
        "What are common misconceptions about {t}?", "How would you explain {t} to a child?",
    ),
    "explain": (
        "Explain {t} in simple terms.", "Give a short explanation of {t} for a beginner.",
        "Explain the pros and cons of {t}.", "Describe how {t} has changed over the last hundred years.",
        "Explain {t} using an everyday analogy.",
    ),
    "summary": (
        "Summarize what is known about {t} in three sentences.", "Write a one-paragraph summary of {t}.",
        "Give me a brief overview of {t}.", "Write a TL;DR about {t}.",
    ),
    "rewrite": (
        "Rewrite this sentence to sound more formal: \"{t} is pretty cool and lots of people like it.\"",
        "Rewrite this in simpler words: \"The phenomenon of {t} exhibits considerable complexity.\"",
        "Make this sentence more exciting: \"{t} is a topic.\"",
        "Fix the grammar in this sentence: \"me and my friend was learning about {t} yesterday.\"",
        "Rewrite this as a friendly tweet: \"We published an article about {t}.\"",
    ),
    "list": (
        "List five facts about {t}.", "Give me three tips related to {t}.", "List the key terms someone learning "
        "about {t} should know.", "What are four questions a student might ask about {t}?",
        "List some books or resources for learning about {t}.",
    ),
    "story": (
        "Write a short story about a child who discovers {t}.", "Write a poem about {t}.",
        "Write a short dialogue between two friends talking about {t}.", "Tell me a bedtime story involving {t}.",
        "Write a haiku about {t}.",
    ),
    "advice": (
        "I want to learn more about {t}. Where should I start?", "What should I know before getting into {t}?",
        "How can I explain {t} to my grandmother?",
    ),
}

CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "returns the factorial of n", "sorts a list of "
    "numbers with bubble sort", "counts the vowels in a string", "finds the largest number in a list",
    "computes the n-th Fibonacci number", "checks whether a word is a palindrome", "removes duplicates from a "
    "list", "converts Celsius to Fahrenheit", "merges two sorted lists", "counts word frequencies in a text",
    "returns the sum of the digits of a number", "flattens a nested list", "checks whether two strings are "
    "anagrams", "finds the greatest common divisor of two numbers", "reads a file and counts its lines",
    "returns the second largest number in a list", "capitalizes every word in a sentence", "implements binary "
    "search", "computes the average of a list", "converts a binary string to an integer", "checks whether a year "
    "is a leap year", "returns all even numbers from a list", "computes the power of a number without using **",
    "generates a multiplication table", "validates an email address with a simple rule", "swaps two variables",
    "finds the missing number in a list of 1 to n", "computes the length of the longest word in a sentence",
)
CODE_PHRASES = (
    "Write a Python function that {c}.", "How do I write a function in Python that {c}?",
    "Write a JavaScript function that {c}.", "Show me code that {c}, with comments.",
    "Write a Python function that {c}, and explain how it works.",
)

MATH_PHRASES = (
    "What is {a} plus {b}?", "What is {a} times {b}?", "What is {a} minus {b}?",
    "If I have {a} apples and buy {b} more, how many apples do I have?",
    "A train travels {a} kilometers in {b} hours. What is its average speed?",
    "What is {b} percent of {a}?", "Solve for x: x + {a} = {b}.", "Is {a} an even or an odd number? Explain.",
    "A shop sells pens for {b} dollars each. How much do {a} pens cost?",
    "What is the area of a rectangle that is {a} meters long and {b} meters wide?",
)


@dataclass(frozen=True)
class Prompt:
    id: str  # stable: the task type and a hash of the text
    kind: str
    text: str
    split: str  # "train" or "heldout"


def _held(name: str, percent: int, seed: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < percent


def _prompt(kind: str, text: str, split: str) -> Prompt:
    return Prompt(f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:12]}", kind, text, split)


def build_prompts(seed: int = 0, heldout_percent: int = 8) -> list[Prompt]:
    """Every prompt of the grid, shuffled by ``seed``. A topic, code task or maths item is held out
    as a whole (about ``heldout_percent`` of them)."""
    rng = random.Random(seed)
    out: list[Prompt] = []
    for topic in TOPICS:
        split = "heldout" if _held(topic, heldout_percent, seed) else "train"
        for kind, phrases in TASKS.items():
            out.extend(_prompt(kind, p.format(t=topic), split) for p in phrases)
    for task in CODE_TASKS:
        split = "heldout" if _held(task, heldout_percent, seed) else "train"
        out.extend(_prompt("code", p.format(c=task), split) for p in CODE_PHRASES)
    for i in range(400):
        phrase = MATH_PHRASES[i % len(MATH_PHRASES)]
        a, b = rng.randint(2, 250), rng.randint(2, 99)
        text = phrase.format(a=a, b=b)
        split = "heldout" if _held(text, heldout_percent, seed) else "train"
        out.append(_prompt("maths", text, split))
    unique = list({p.id: p for p in out}.values())
    rng.shuffle(unique)
    return unique


def split_prompts(prompts: list[Prompt], split: str) -> list[Prompt]:
    return [p for p in prompts if p.split == split]
