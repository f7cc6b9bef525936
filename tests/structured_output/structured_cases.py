"""The constraints the real-model tests run: JSON schemas, regexes and choices, each with a
prompt that asks for it (a unique module name: test folders share sys.path)."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 20}

SCHEMAS: list[tuple[str, dict]] = [
    (
        "a person with a name and an age",
        {
            "type": "object",
            "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"],
        },
    ),
    (
        "a city and its country",
        {
            "type": "object",
            "properties": {"city": NAME, "country": NAME},
            "required": ["city", "country"],
        },
    ),
    (
        "a colour",
        {
            "type": "object",
            "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
            "required": ["color"],
        },
    ),
    (
        "a temperature in Celsius",
        {
            "type": "object",
            "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60}},
            "required": ["celsius"],
        },
    ),
    (
        "whether the sky is blue",
        {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]},
    ),
    (
        "three fruits",
        {
            "type": "object",
            "properties": {
                "fruits": {"type": "array", "items": NAME, "minItems": 3, "maxItems": 3}
            },
            "required": ["fruits"],
        },
    ),
    (
        "a book with its author",
        {
            "type": "object",
            "properties": {
                "title": NAME,
                "author": {
                    "type": "object",
                    "properties": {"first": NAME, "last": NAME},
                    "required": ["first", "last"],
                },
            },
            "required": ["title", "author"],
        },
    ),
    (
        "a point on a grid",
        {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -10, "maximum": 10},
                "y": {"type": "integer", "minimum": -10, "maximum": 10},
            },
            "required": ["x", "y"],
        },
    ),
    (
        "a rating from 1 to 5",
        {
            "type": "object",
            "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5}},
            "required": ["stars"],
        },
    ),
    (
        "the primary colours",
        {
            "type": "array",
            "items": {"type": "string", "enum": ["red", "yellow", "blue"]},
            "minItems": 1,
            "maxItems": 3,
        },
    ),
    ("a yes or no answer", {"type": "string", "enum": ["yes", "no"]}),
    ("a number between 1 and 100", {"type": "integer", "minimum": 1, "maximum": 100}),
    (
        "a product with a price",
        {
            "type": "object",
            "properties": {
                "product": NAME,
                "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
            },
            "required": ["product", "price"],
            "additionalProperties": False,
        },
    ),
    (
        "a weekday",
        {
            "type": "object",
            "properties": {
                "day": {
                    "enum": [
                        "Monday",
                        "Tuesday",
                        "Wednesday",
                        "Thursday",
                        "Friday",
                        "Saturday",
                        "Sunday",
                    ]
                }
            },
            "required": ["day"],
        },
    ),
    (
        "an animal and how many legs it has",
        {
            "type": "object",
            "properties": {
                "animal": NAME,
                "legs": {"type": "integer", "minimum": 0, "maximum": 8},
                "can_fly": {"type": "boolean"},
            },
            "required": ["animal", "legs", "can_fly"],
        },
    ),
    (
        "a user with an address",
        {
            "type": "object",
            "properties": {
                "user": NAME,
                "address": {
                    "type": "object",
                    "properties": {
                        "street": NAME,
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["street", "zip"],
                },
            },
            "required": ["user", "address"],
        },
    ),
    (
        "two points",
        {
            "type": "array",
            "minItems": 2,
            "maxItems": 2,
            "items": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["x", "y"],
            },
        },
    ),
    (
        "a status",
        {
            "type": "object",
            "properties": {
                "status": {"const": "ok"},
                "code": {"type": "integer", "minimum": 100, "maximum": 599},
            },
            "required": ["status", "code"],
        },
    ),
    (
        "a task list",
        {
            "type": "object",
            "properties": {
                "tasks": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 2,
                    "items": {
                        "type": "object",
                        "properties": {"title": NAME, "done": {"type": "boolean"}},
                        "required": ["title", "done"],
                    },
                }
            },
            "required": ["tasks"],
        },
    ),
    (
        "a shape",
        {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"circle": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["circle"],
                },
                {
                    "type": "object",
                    "properties": {"square": {"type": "integer", "minimum": 1, "maximum": 9}},
                    "required": ["square"],
                },
            ]
        },
    ),
    (
        "a language and its year",
        {
            "type": "object",
            "properties": {
                "language": {"type": "string", "enum": ["Python", "C", "Rust", "Java"]},
                "year": {"type": "integer", "minimum": 1950, "maximum": 2025},
            },
            "required": ["language", "year"],
        },
    ),
    (
        "a probability",
        {
            "type": "object",
            "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1}},
            "required": ["p"],
        },
    ),
]

REGEXES: list[tuple[str, str]] = [
    ("a phone number", r"[0-9]{3}-[0-9]{3}-[0-9]{4}"),
    ("a date", r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    ("an email address", r"[a-z]{1,10}@[a-z]{1,10}\.(com|org|net)"),
    ("a time of day", r"([01][0-9]|2[0-3]):[0-5][0-9]"),
    ("a hex colour", r"#[0-9a-f]{6}"),
    ("a yes or no answer", r"(Yes|No)\."),
    (
        "an IPv4 address",
        r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])",
    ),
    ("a capitalised word", r"[A-Z][a-z]{2,12}"),
]

CHOICES: list[tuple[str, list[str]]] = [
    ("Is the sun hot?", ["yes", "no"]),
    ("What colour is grass?", ["red", "green", "blue"]),
    ("Pick a planet.", ["Mercury", "Venus", "Earth", "Mars"]),
    ("How do you feel?", ["happy", "sad", "neutral"]),
    ("Which is a fruit?", ["apple", "car", "house"]),
]


def _closed(node):
    """additionalProperties: false on every object that lists its properties (as OpenAI's
    strict mode asks): a small model otherwise tends to invent keys until max_tokens."""
    if isinstance(node, list):
        return [_closed(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _closed(v) for k, v in node.items()}
    if "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


SCHEMAS = [
    (what, schema if what.startswith("a city") else _closed(schema)) for what, schema in SCHEMAS
]
