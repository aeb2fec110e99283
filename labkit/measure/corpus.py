"""A seeded, offline generator of simple English children's stories.

First used in notebook 01 (anatomy_of_a_request) for in-domain prompts. The bundled model
(data/labkit-tiny, trained by scripts/train_bundled_model.py) learned from exactly this text, so prompts
drawn from here continue as readable English: a broken KV cache or scheduler then shows as gibberish.

Every public function is pure: it takes a `seed` (or a `random.Random`) and uses no global state, so the
same call always returns the same text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from labkit.measure.story_templates import ENDINGS, INTROS, MEETS, OPENINGS, PLOTS

# Vocabulary: space-separated words ("_" joins a multi-word item).
GIRLS = ("Lily Mia Emma Lucy Sara Anna Ella Zoe Ruby Rosa Amy Nina Maya Ivy Jane Kate Sue Tina Molly Daisy "
         "Hannah Grace Chloe Nora Luna Bella Hazel Clara Alice Poppy Olivia Sophie Lola Iris Rose Wendy Holly "
         "Fiona Gemma Jenny Kitty Lena Mila Nell Pippa Tess Violet Willow Abby Cora Beatrix Matilda Penelope "
         "Scarlett Gwendolyn Rosalind").split()
BOYS = ("Tom Ben Max Sam Leo Jack Tim Finn Noah Oscar Jake Eli Hugo Ollie Milo Theo Luke Adam Pete Joe Dan Owen "
        "Toby Charlie Henry Billy Jonah Felix Bobby Ned Arthur Bruno Caleb Dexter Ethan Frank George Harry Ivan "
        "Jasper Kevin Louis Marco Nick Patrick Ralph Simon Victor Walter Zack Rupert Sebastian Humphrey "
        "Barnaby").split()
ANIMALS = ("cat dog fox rabbit bear bird duck frog mouse owl pig cow horse lion tiger elephant monkey turtle "
           "squirrel deer goat sheep hen puppy kitten bunny hedgehog penguin dolphin fish bee butterfly ladybug "
           "snail wolf zebra giraffe panda koala otter beaver raccoon parrot lamb chick crab seal mole moose "
           "camel kangaroo hippo crocodile swan goose donkey pony chipmunk robin badger ant dragon unicorn "
           "dinosaur gorilla flamingo peacock octopus walrus whale lobster bat eagle hamster sparrow "
           "jellyfish").split()
TRAITS = ("little small kind brave curious happy shy clever funny gentle friendly playful sleepy tiny silly "
          "busy quiet cheerful careful young smart sweet lazy noisy fluffy strong wise lucky proud bold hungry "
          "helpful honest polite").split()
PLACES = ("in:park in:forest in:garden on:farm at:beach by:river by:lake in:meadow on:hill in:village in:field "
          "by:pond near:school in:library at:zoo near:playground near:mountain near:castle in:jungle on:island "
          "in:orchard in:valley near:market in:backyard near:cave in:desert by:sea near:bakery near:station "
          "in:city near:windmill by:waterfall near:barn").split()
PLACE_ADJ = ("big green quiet sunny old beautiful small busy shady peaceful lovely wide dark bright pretty "
             "magical faraway snowy sleepy enormous").split()
OBJECTS = ("ball kite hat book toy_car doll teddy_bear box balloon drum boat cup blanket shell stone flower "
           "apple cookie key map bell crayon scarf sock umbrella basket feather ring robot puzzle bike spoon "
           "lamp jar whistle necklace backpack train pillow crown wand shovel bucket marble button candle clock "
           "mirror trumpet guitar brush sled wagon glove pencil bracelet rocket jacket lantern compass trophy "
           "paintbrush tambourine xylophone ribbon telescope").split()
COLOURS = "red blue green yellow orange purple pink white brown gold silver grey".split()
GOOD = "happy glad proud excited calm thankful joyful cheerful safe".split()
BAD = "sad scared worried lonely tired upset grumpy nervous afraid".split()
HOBBIES = ("play_in_the_sun run_fast jump_in_puddles read_books sing_songs dance draw_pictures climb_trees "
           "swim_in_the_pond build_sand_castles pick_flowers play_with_friends bake_cakes fly_kites "
           "explore_new_places count_the_clouds splash_in_the_water listen_to_stories collect_shiny_stones "
           "play_hide_and_seek look_at_the_stars ride_a_bike paint_pictures play_music grow_vegetables "
           "knit_warm_scarves watch_the_sunset feed_the_ducks chase_butterflies make_paper_boats skip_rope "
           "roll_down_the_hill play_the_drum watch_the_birds dig_holes tell_jokes blow_bubbles juggle_oranges "
           "whistle_tunes plant_trees solve_riddles").split()
TIMES = ("One sunny morning|One rainy day|One cold winter day|One warm summer evening|One windy afternoon|"
         "One bright spring day|One quiet night|The next day|One snowy morning|One foggy morning|"
         "One lazy Sunday|One chilly autumn day|After breakfast one day|Early one morning|Late one evening|"
         "One cloudy Tuesday").split("|")
SNACKS = ("apples cookies berries carrots bread cheese nuts grapes cherries plums muffins sandwiches pears "
          "peaches crackers biscuits strawberries oranges pancakes").split()
FILLINGS = "apples berries honey nuts carrots chocolate lemons bananas".split()
STUCK = "kite ball hat balloon scarf frisbee".split()
HIDES = ("under a big tree|behind a rock|in the tall grass|under a bush|near the old fence|inside a hollow log|"
         "under the bed|next to the water|behind the door|under a pile of leaves|behind the big barn|"
         "under a wooden bench|between two flowers|on top of a hill|beside a tiny stream").split("|")
FEARS = ("the dark|the big waves|the loud thunder|the tall slide|the deep water|the old bridge|"
         "the big dog next door|the high tree|the noisy storm|the dark cave|the spooky shadows").split("|")
GAMES = ("tag|hide and seek|catch|a running game|a clapping game|with a ball|pretend|a jumping game|"
         "with blocks|with a kite|a guessing game").split("|")
SAID = "said shouted whispered replied cried".split()


def _w(word: str) -> str:
    return word.replace("_", " ")


def _a(word: str) -> str:
    """Indefinite article for `word`: "an owl", "a fox"."""
    return ("an " if word[0] in "aeiou" else "a ") + word


@dataclass(frozen=True)
class Character:
    name: str
    kind: str  # "fox", "girl", ...
    girl: bool

    def fields(self, prefix: str) -> dict[str, str]:
        """Template fields for this character: name, kind and pronouns, each key prefixed ("f" for the friend)."""
        he, his, him = ("she", "her", "her") if self.girl else ("he", "his", "him")
        out = {"name": self.name, "kind": self.kind, "he": he, "his": his, "him": him,
               "He": he.capitalize(), "His": his.capitalize()}
        return {prefix + k: v for k, v in out.items()}


def _character(rng: random.Random, kind: str | None = None, avoid: str = "", animal: bool = False) -> Character:
    girl = rng.random() < 0.5
    name = rng.choice([n for n in (GIRLS if girl else BOYS) if n != avoid])
    if kind is None:  # the hero is sometimes a child; the friend is always an animal ("Ben the fox")
        kind = rng.choice(ANIMALS) if animal or rng.random() < 0.75 else ("girl" if girl else "boy")
    return Character(name, kind, girl)


def _fields(rng: random.Random, hero: Character, friend: Character, place: str | None) -> dict[str, str]:
    prep, where = (place or rng.choice(PLACES)).split(":")
    colour, obj, hide = rng.choice(COLOURS), _w(rng.choice(OBJECTS)), rng.choice(HIDES)
    return {**hero.fields(""), **friend.fields("f"), "fkind_a": _a(friend.kind), "prep": prep, "place": where,
            "trait_a": _a(rng.choice(TRAITS)), "a_place_adj": _a(rng.choice(PLACE_ADJ)),
            "hobby": _w(rng.choice(HOBBIES)), "colour": colour, "colour_a": _a(colour),
            "obj": obj, "Obj_a": _a(obj).capitalize(),
            "good": rng.choice(GOOD), "bad": rng.choice(BAD), "fbad": rng.choice(BAD),
            "time": rng.choice(TIMES), "hide": hide, "hide2": rng.choice([h for h in HIDES if h != hide]),
            "snack": rng.choice(SNACKS), "filling": rng.choice(FILLINGS), "stuck": rng.choice(STUCK),
            "fear": rng.choice(FEARS), "game": rng.choice(GAMES), "said": rng.choice(SAID),
            "a_adj_box": _a(rng.choice(["small", "old", "shiny", "wooden", colour]))}


def _story_sentences(rng: random.Random, kind: str | None, place: str | None) -> list[str]:
    hero = _character(rng, kind)
    friend = _character(rng, avoid=hero.name, animal=True)
    f = _fields(rng, hero, friend, place)
    templates = [rng.choice(OPENINGS)] + rng.sample(INTROS, rng.randint(1, 2))
    templates += [rng.choice(MEETS) if t == "@meet" else t for t in PLOTS[rng.choice(sorted(PLOTS))]]
    templates.append(rng.choice(ENDINGS))
    return [t.format(**f) for t in templates]


def generate_story(rng: random.Random, kind: str | None = None, place: str | None = None) -> str:
    """One story of about 100-150 words. `kind` ("dog") and `place` ("in:forest", see PLACES) pin its subject."""
    return " ".join(_story_sentences(rng, kind, place))


def generate_stories(n: int, seed: int) -> list[str]:
    """`n` stories drawn from one `random.Random(seed)`."""
    rng = random.Random(seed)
    return [generate_story(rng) for _ in range(n)]


def story_prompts(n: int, seed: int) -> list[str]:
    """In-domain prompt openings: a story's first sentences, then the first words of the next one.

    e.g. "Once upon a time, there was a kind fox named Lily. Lily loved to sing songs. One day, Lily"
    """
    rng = random.Random(seed)
    prompts: list[str] = []
    for _ in range(n):
        sentences = _story_sentences(rng, None, None)
        keep = rng.randint(1, 3)
        while sentences[keep].startswith('"'):  # cut inside narration, not dialogue
            keep += 1
        words = sentences[keep].split()
        prompts.append(" ".join(sentences[:keep] + words[: rng.randint(1, max(1, min(3, len(words) - 1)))]))
    return prompts


def long_text(num_words: int, seed: int) -> str:
    """About `num_words` words of in-domain text: whole stories joined by blank lines, the last one cut short."""
    rng = random.Random(seed)
    stories: list[str] = []
    count = 0
    while count < num_words:
        words = generate_story(rng).split(" ")[: num_words - count]
        stories.append(" ".join(words))
        count += len(words)
    return "\n\n".join(stories)


def chat_examples(n: int, seed: int) -> list[list[dict[str, str]]]:
    """Tiny conversations in OpenAI message format: a request for a story, and a story about it in reply."""
    rng = random.Random(seed)
    asks = ["Tell me a story about {a}.", "Can you tell me a story about {a}?", "Please tell me a story about {a}.",
            "Write a short story about {a}.", "I want a story about {a}.", "Tell me a story about {a} {where}."]
    examples: list[list[dict[str, str]]] = []
    for _ in range(n):
        kind, place, ask = rng.choice(ANIMALS), rng.choice(PLACES), rng.choice(asks)
        where = place.replace(":", " the ")
        messages = [{"role": "user", "content": ask.format(a=_a(kind), where=where)}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": "You are a friendly storyteller for children."})
        story = generate_story(rng, kind=kind, place=place if "{where}" in ask else None)
        messages.append({"role": "assistant", "content": story})
        examples.append(messages)
    return examples
