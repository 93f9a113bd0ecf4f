"""Parameterised-template items for the fidelity evaluation (benchmarks/evalset/tasks.py).

Each schema has a fixed-instructions module and a record module whose fields are `<param>` slots
(customer ticket, hotel booking, parcel shipment). A prompt imports both, fills the record's arguments
as attributes and asks for one field, so the answer is checkable. Arguments are passed with a leading
space (the slot follows "Field:"). Each slot's `len` exceeds the longest value its pool can produce in
SmolLM2's tokenizer (checked over every combination: person 7 tokens, date 9, code 8, city/product/room/
hotel 3); `python -m benchmarks.evalset.calibrate --check` plans every prompt, which rejects an overflow.
"""

from __future__ import annotations

import random
from xml.sax.saxutils import escape, quoteattr

FIRST = ["Mara", "Tomas", "Elena", "Jonah", "Priya", "Oskar", "Leila", "Bruno", "Ingrid", "Kofi", "Sana",
         "Felix", "Nadia", "Hugo", "Amara", "Viktor", "Rosa", "Dmitri", "Yuki", "Lucas", "Freya", "Omar"]
LAST_SYLLABLES = ["kel", "so", "var", "den", "mo", "rin", "tas", "bel", "lo", "wen", "dra", "gus", "pir", "na"]
CITIES = ["Lisbon", "Oslo", "Cairo", "Lima", "Kyoto", "Dublin", "Porto", "Quito", "Nairobi", "Krakow", "Hanoi",
          "Seville", "Bergen", "Tunis", "Dakar", "Leeds", "Graz", "Turin", "Perth", "Boston", "Denver", "Austin"]
PRODUCTS = ["espresso machine", "electric kettle", "hiking boots", "desk lamp", "rice cooker", "yoga mat",
            "wool blanket", "bread maker", "tennis racket", "garden hose", "office chair", "rain jacket",
            "toaster", "backpack", "blender", "bookshelf", "microwave", "sleeping bag", "coffee grinder"]
ROOMS = ["single room", "double room", "twin room", "family suite", "junior suite", "studio", "penthouse",
         "sea view room", "garden room", "attic room"]
HOTELS = ["Grand Harbour", "Blue Pine", "Old Mill", "Silver Lake", "Red Fox Inn", "Cedar Lodge", "Sunrise Hotel",
          "Palm Court", "North Star", "Stone Bridge", "Willow Inn", "Hotel Aurora"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]

# schema name -> (system, instructions module text, record title, fields);
# field = (param name, label in the record, len, value kind, question)
TEMPLATES = {
    "ticket": (
        "You are a customer support assistant. Answer the question with a short phrase copied from the ticket.",
        "Support policy: refunds are possible within thirty days of delivery, and replacement parts are "
        "shipped free of charge. Always confirm the customer's details before changing an order, and never "
        "share payment information in a message.",
        "Support ticket",
        [("customer", "Customer name", 8, "person", "What is the customer's name?"),
         ("agent", "Support agent", 8, "person", "What is the name of the support agent?"),
         ("city", "Customer city", 4, "city", "In which city does the customer live?"),
         ("product", "Product", 6, "product", "Which product did the customer order?"),
         ("order", "Order number", 10, "code", "What is the order number?"),
         ("invoice", "Invoice number", 10, "code", "What is the invoice number?"),
         ("ordered", "Order date", 12, "date", "On which date was the order placed?"),
         ("delivered", "Delivery date", 12, "date", "On which date was the order delivered?")]),
    "booking": (
        "You are a hotel reservation assistant. Answer the question with a short phrase copied from the booking.",
        "Booking rules: check-in starts at three in the afternoon and check-out is before eleven in the "
        "morning. Breakfast is served in the main hall. Cancellations are free until two days before arrival.",
        "Hotel booking",
        [("guest", "Guest name", 8, "person", "What is the name of the guest?"),
         ("booker", "Booked by", 8, "person", "Who made the booking?"),
         ("hotel", "Hotel", 6, "hotel", "At which hotel is the booking?"),
         ("city", "City", 4, "city", "In which city is the hotel?"),
         ("room", "Room type", 6, "room", "What type of room was booked?"),
         ("code", "Confirmation code", 10, "code", "What is the confirmation code?"),
         ("checkin", "Check-in date", 12, "date", "What is the check-in date?"),
         ("checkout", "Check-out date", 12, "date", "What is the check-out date?")]),
    "shipment": (
        "You are a logistics assistant. Answer the question with a short phrase copied from the shipment record.",
        "Shipping notes: parcels are delivered on weekdays between eight in the morning and six in the "
        "evening. A signature is required for parcels over a certain value, and damaged parcels must be "
        "reported within two days.",
        "Shipment record",
        [("sender", "Sender", 8, "person", "Who sent the parcel?"),
         ("recipient", "Recipient", 8, "person", "Who is the recipient of the parcel?"),
         ("origin", "Origin city", 4, "city", "From which city was the parcel sent?"),
         ("destination", "Destination city", 4, "city", "What is the destination city?"),
         ("item", "Item", 6, "product", "Which item is being shipped?"),
         ("tracking", "Tracking number", 10, "code", "What is the tracking number?"),
         ("shipped", "Shipping date", 12, "date", "On which date was the parcel shipped?"),
         ("delivery", "Delivery date", 12, "date", "On which date will the parcel be delivered?")]),
}


def schema_text(name: str) -> str:
    system, instructions, title, fields = TEMPLATES[name]
    lines = "".join(f'{escape(label)}:<param name="{param}" len="{length}"/>\n'
                    for param, label, length, _, _ in fields)
    return (f'<schema name="{name}"><system>{escape(system)}</system><user>'
            f'<module name="instructions" xml:space="preserve">{escape(instructions)}\n\n</module>'
            f'<module name="record" xml:space="preserve">{escape(title)}\n{lines}\n</module>'
            f"</user></schema>")


def _value(rng: random.Random, kind: str) -> tuple[str, tuple[str, ...]]:
    """A value of `kind` (the argument, without its leading space) and its accepted answers."""
    if kind == "person":
        last = "".join(rng.choice(LAST_SYLLABLES) for _ in range(2)).capitalize()
        value = f"{rng.choice(FIRST)} {last}"
        return value, (value,)
    if kind == "code":
        letters = "".join(rng.choice("ABCDEFGHJKLMNPRSTUVWXYZ") for _ in range(2))
        digits = str(rng.randint(10000, 99999))
        return f"{letters}-{digits}", (f"{letters}-{digits}", digits)  # the digits alone identify it
    if kind == "date":
        day, month, year = rng.randint(1, 28), rng.choice(MONTHS), rng.randint(2019, 2025)
        suffix = {1: "st", 2: "nd", 3: "rd", 21: "st", 22: "nd", 23: "rd"}.get(day, "th")
        value = f"{day} {month} {year}"
        return value, (value, f"{month} {day}, {year}", f"{day}{suffix} {month} {year}",
                       f"{day}{suffix} of {month} {year}", f"{month} {day}{suffix}, {year}")
    pool = {"city": CITIES, "product": PRODUCTS, "room": ROOMS, "hotel": HOTELS}[kind]
    value = rng.choice(pool)
    return value, (value,)


def template_items(count: int, seed: int) -> tuple[dict[str, str], list[tuple[str, str, tuple[str, ...], dict]]]:
    """The schemas and `count` items as (schema_name, prompt, answers, meta); templates and asked field balanced."""
    rng = random.Random(f"template-{seed}")
    names = list(TEMPLATES)
    items = []
    for i in range(count):
        name = names[i % len(names)]
        _, _, _, fields = TEMPLATES[name]
        asked = (i // len(names)) % len(fields)
        arguments, answers, used = [], (), set()
        for index, (param, _, _, kind, _) in enumerate(fields):
            value, accepted = _value(rng, kind)
            while used & set(accepted):  # the two names (cities, dates, codes) of one record differ
                value, accepted = _value(rng, kind)
            used.update(accepted)
            arguments.append(f"{param}={quoteattr(' ' + value)}")
            if index == asked:
                answers = accepted
        param, _, _, _, question = fields[asked]
        prompt = (f'<prompt schema="{name}"><user><instructions/><record {" ".join(arguments)}/>'
                  f"Question: {escape(question)}</user><assistant/></prompt>")
        meta = {"k": 1, "target_position": 0, "template": name, "param": param, "param_index": asked,
                "num_params": len(fields)}
        items.append((name, prompt, answers, meta))
    return {name: schema_text(name) for name in names}, items
