"""Generate the conversation evaluation set: long two-person chats and questions labelled by construction.

    python bench/data/make_conversations.py          # writes conversations.jsonl and conversation_questions.jsonl

Stdlib only, fixed seed: a rerun writes identical bytes. Each conversation is a series of sessions days
or weeks apart (2023-2024) between two people with jobs, family, pets, trips, hobbies and plans. Every
dialog turn is one memory in the seed-file format (``ibex-context seed --file``): content
``"Name: text"``, created_at the session's date and time (plus a few seconds per turn, so turns keep
their order), memory_id ``c<conversation>-s<session>-t<turn>``, one agent per conversation.

Facts are events, each mentioned once: a statement by its owner (often with a relative date such as
"yesterday" or "last Friday"), a reaction by the other person, a detail in a follow-up turn that
refers back with "it", "she" or "that place". Between them runs chatter (greetings, reactions,
questions back, small talk) that answers nothing. Each person has look-alike events (two trips, two
pets; both people have pets, trips and books), so word matching alone confuses them.

Questions come from the events, so their evidence turns are known by construction:

* ``single-hop``: one evidence turn, usually naming the key entity.
* ``multi-hop``: two evidence turns (a statement and its follow-up detail, or two events in different
  sessions: both pets, both trips, which came first).
* ``temporal``: "When did ...?"; the answer is the session date moved by the turn's relative words.
* ``paraphrased``: no content word shared with any evidence turn (stop words out, words compared by
  a crude stem and a five-letter prefix: stricter than the memory service's own matching).
* ``no-answer``: about something the conversation never says (an absent pet, city, sibling, or the
  other person's event); no evidence.
* ``people``: how someone a speaker mentions is related to them ("How is Walt related to Jonah?"); every
  turn where the speaker names that person with the relation is evidence.
* ``open-domain``: answered by inference from a statement ("Does Jonah need someone to look after an
  animal when he goes away?"); the owner's statements of that kind are the evidence.

The last two are drawn after the others from a random stream of their own, so every earlier question
and turn is unchanged.
"""

from __future__ import annotations

import json
import random
import re
import unicodedata
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path

SEED = 20231
HERE = Path(__file__).resolve().parent
CONVERSATIONS_FILE = HERE / "conversations.jsonl"
QUESTIONS_FILE = HERE / "conversation_questions.jsonl"
ORG = "evalconv"
# Questions per conversation, by category.
QUOTA = {"single-hop": 16, "multi-hop": 12, "temporal": 14, "paraphrased": 12, "no-answer": 10}
MIN_TURNS = 300

# The memory service's stop words (memory/embedders/embed.py), so "no shared content word" here implies the same there.
STOPWORDS = frozenset(
    """a about above after again against all am an and any are as at be because been before being
    below between both but by can could did do does doing down during each few for from further had
    has have having he her here hers herself him himself his how i if in into is it its itself just
    me more most my myself no nor not now of off on once only or other our ours ourselves out over
    own same she should so some such than that the their theirs them themselves then there these
    they this those through to too under until up very was we were what when where which while who
    whom why will with would you your yours yourself yourselves user users s t""".split()
)
_WORD = re.compile(r"\w+", re.UNICODE)


def _plural_stem(word: str) -> str:
    """The memory service's stemmer (English plurals)."""
    if not word.isascii() or len(word) <= 3:
        return word
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith(("sses", "xes", "ches", "shes", "zzes")):
        return word[:-2]
    if word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


def _root(word: str) -> str:
    """A crude stem on top of the plural one (-ing, -ed, -er, -ly, -ion, -ment), cut to five letters."""
    w = _plural_stem(word)
    for suffix in ("ation", "ment", "ing", "ion", "ed", "er", "ly", "e", "y"):
        if w.endswith(suffix) and len(w) - len(suffix) >= 3:
            w = w[: -len(suffix)]
            break
    return w[:5]


def content_roots(text: str) -> set[str]:
    """Roots of the content words of ``text`` (stop words and single digits out)."""
    out: set[str] = set()
    for raw in _WORD.findall(unicodedata.normalize("NFKC", text).casefold()):
        if raw in STOPWORDS or (raw.isdigit() and len(raw) == 1):
            continue
        out.add(_root(raw))
    return out


# ------------------------------------------------------------------------------------ people

PEOPLE = [
    # (name, she/he, job, workplace, promoted role, kin [(relation, name)])
    [("Priya", "she", "pediatric nurse", "St. Brigid's Hospital", "charge nurse",
      [("sister", "Anjali"), ("mom", "Lakshmi"), ("cousin", "Dev")]),
     ("Jonah", "he", "high school chemistry teacher", "Westbrook High", "head of the science department",
      [("husband", "Marcus"), ("dad", "Walt"), ("niece", "Tilly")])],
    [("Marisol", "she", "graphic designer", "Lumen Studio", "lead designer",
      [("daughter", "Lucia"), ("sister", "Carmen"), ("grandma", "Rosa")]),
     ("Theo", "he", "paramedic", "the county EMS", "crew chief",
      [("wife", "Hannah"), ("son", "Milo"), ("cousin", "Brendan")])],
    [("Aiko", "she", "marine biologist", "the Coastal Research Institute", "project lead",
      [("partner", "Sam"), ("mom", "Emiko"), ("aunt", "Noriko")])],
    [("Ingrid", "she", "pastry chef", "Maison Colette", "head pastry chef",
      [("son", "Erik"), ("sister", "Freja"), ("dad", "Nils")]),
     ("Rafael", "he", "software engineer", "a logistics startup called Freightly", "engineering manager",
      [("girlfriend", "Bea"), ("mom", "Graça"), ("nephew", "Tiago")])],
    [("Noor", "she", "librarian", "the Fairview Public Library", "branch manager",
      [("husband", "Karim"), ("daughter", "Layla"), ("cousin", "Yusuf")]),
     ("Callum", "he", "landscape architect", "Greenline Partners", "associate principal",
      [("sister", "Fiona"), ("dad", "Angus"), ("girlfriend", "Isla")])],
]
PEOPLE[2].append(("Deshawn", "he", "accountant", "Barrow & Finch", "senior associate",
                  [("wife", "Keisha"), ("daughter", "Amara"), ("grandma", "Loretta")]))


@dataclass
class Person:
    name: str
    pron: str  # she / he
    job: str
    workplace: str
    role: str
    kin: list[tuple[str, str]]

    @property
    def poss(self) -> str:
        return "her" if self.pron == "she" else "his"

    @property
    def obj(self) -> str:
        return "her" if self.pron == "she" else "him"


# ------------------------------------------------------------------------------------ pools

SPECIES = ["dog", "cat", "rabbit", "guinea pig", "ferret", "tortoise"]
ABSENT_SPECIES = ["parrot", "hamster", "horse", "goldfish", "iguana"]
PET_NAMES = ["Biscuit", "Pepper", "Mochi", "Juniper", "Waffles", "Pickle", "Olive", "Ziggy", "Noodle",
             "Clementine", "Basil", "Tofu", "Marzipan", "Gus", "Pumpernickel", "Sprocket", "Fennel", "Dumpling",
             "Rocket", "Hazel"]
PET_SOURCES = ["the shelter on Elm Street", "a rescue group in Dayton", "my neighbor's farm",
               "a breeder two towns over", "the county animal shelter", "a coworker whose landlord banned pets"]
QUIRKS = ["steals socks and hides them under the bed", "sleeps in the bathtub", "howls whenever the kettle whistles",
          "refuses to go outside when it drizzles", "chews every shoelace in the house",
          "sits on my laptop whenever I open it", "drags a squeaky carrot everywhere",
          "stares at the fridge at exactly six every evening", "knocks pens off the desk one by one"]
CITIES = ["Lisbon", "Kyoto", "Reykjavik", "Oaxaca", "Edinburgh", "Cape Town", "Hanoi", "Vancouver", "Dubrovnik",
          "Marrakesh", "Tbilisi", "Cartagena", "Hobart", "Bergen", "Porto", "Seoul", "Valparaiso", "Ljubljana",
          "Tallinn", "Montreal"]
ABSENT_CITIES = ["Nairobi", "Helsinki", "Buenos Aires", "Prague", "Havana", "Manila"]
HIGHLIGHTS = ["the sunrise hike up the old volcano", "the night market by the river",
              "a tiny jazz bar we found by accident",
              "the boat tour along the cliffs", "the thermal baths", "the cable car ride at dusk",
              "a street art walk with a local guide", "the botanical garden with the giant lily pads"]
FOODS = ["custard tarts", "grilled octopus", "steamed dumplings", "mole negro", "smoked salmon", "pho for breakfast",
         "fresh churros", "khachapuri", "fish stew", "sticky rice with mango"]
INSTRUMENTS = ["cello", "ukulele", "banjo", "piano", "saxophone", "violin", "mandolin", "harmonica"]
ABSENT_INSTRUMENTS = ["bagpipes", "trombone", "harp", "accordion"]
TEACHERS = ["Mr. Abernathy", "Ms. Okonkwo", "a guy named Lars", "Beatriz", "Mrs. Takahashi", "Dmitri",
            "a retired jazz player named Otis", "Ms. Varga"]
PIECES = ["a Bach minuet", "Blackbird by the Beatles", "a bluegrass tune called Salt Creek", "Clair de Lune",
          "a slow Hungarian waltz", "Take Five", "an old sea shanty", "Moon River"]
RACES = ["the Riverside Half Marathon", "the Harbor 10K", "the Ridgeline Trail Run", "the Lakeshore Sprint Triathlon",
         "the Maple Leaf 5K", "the Old Bridge Relay"]
RACE_TIMES = ["1:52:40", "48 minutes flat", "2:11:05", "1:27:18", "26 minutes and change", "55:30"]
BOOKS = [("The Salt Road", "Imani Okafor", "two sisters smuggling letters across a border"),
         ("Winter Orchard", "Tomas Lindqvist", "a widower who restores an abandoned apple farm"),
         ("The Glass Cartographer", "Leila Haddad", "a mapmaker who draws cities before they exist"),
         ("Small Hours", "June Marlowe", "a night-shift cleaner who solves a museum theft"),
         ("Bright Ferns", "Kwame Asante", "a botanist stranded on a research island"),
         ("The Lantern Keeper", "Sofia Reyes", "a lighthouse family during a long storm"),
         ("Paper Tigers", "Hana Kim", "twins who run rival bakeries"),
         ("North of Nowhere", "Elliot Crane", "a road trip with a grandfather who has dementia"),
         ("The Quiet Engine", "Rhea Patel", "a train mechanic in the 1920s"),
         ("Velvet Static", "Owen Brandt", "a radio DJ who hears messages in the noise")]
BANDS = ["The Velvet Marmots", "Paper Lanterns", "Neon Orchard", "The Brass Comets", "Juniper Fields", "Static Bloom",
         "The Hollow Pines", "Saltwater Choir", "Midnight Tram", "Copper Foxes"]
VENUES = ["the Roxy", "Pier 9 Amphitheater", "the Blue Heron Ballroom", "Cedar Hall", "the Foundry", "the Lantern Room"]
SONGS = ["Ghost Lights", "Copper Sky", "Tidal", "Northbound", "Paper Moon", "Wildfire Season", "Glasshouse", "Undertow"]
HOODS = ["Maple Heights", "the Old Mill district", "Harbor View", "Linden Park", "Cobble Hill", "Ashford Square"]
FEATURES = ["a little balcony with a lemon tree", "a claw-foot bathtub", "a sunroom full of plants",
            "a backyard big enough for tomatoes", "a real wood-burning fireplace", "a window seat facing the hills"]
COURSES = [("pottery", "class", "a wobbly blue mug"), ("watercolor", "course", "a painting of a heron"),
           ("woodworking", "class", "a tiny step stool"), ("bread-baking", "course", "a loaf shaped like a turtle"),
           ("glassblowing", "class", "a green glass paperweight"),
           ("calligraphy", "course", "a birthday card for my grandma"),
           ("stand-up comedy", "class", "a five-minute set about my commute")]
STUDIOS = ["Kiln & Co.", "the Riverside Arts Center", "Heartwood Studio", "the community college", "the Ember Loft"]
CHARITIES = [("the Eastside Food Bank", "sorting donations on Saturday mornings"),
             ("Paws & Whiskers Rescue", "walking the older dogs on Sundays"),
             ("the Fairmount literacy program", "reading with second graders twice a week"),
             ("the community garden on 5th Street", "running the compost rota"),
             ("the Harbor Lane shelter kitchen", "cooking Thursday dinners"),
             ("Second Chance Bikes", "fixing donated bicycles for kids")]
GIFTS = ["a hand-knit scarf", "a vintage record player", "a silver pocket compass", "a patchwork quilt",
         "a framed map of our hometown", "a cast-iron skillet", "a leather-bound journal"]
OCCASIONS = ["birthday", "graduation", "anniversary", "housewarming"]
PARTS = ["ankle", "wrist", "knee", "shoulder"]
CAUSES = ["tripping over a garden hose", "slipping on ice outside the bakery", "falling off a paddleboard",
          "playing pickleball with my cousin", "moving a couch up three flights of stairs"]
RESTAURANTS = [("Osteria Lupa", "Italian", "squid-ink pasta"), ("Sakura Den", "Japanese", "black sesame ramen"),
               ("La Cabaña", "Peruvian", "lomo saltado"), ("Blue Fig", "Mediterranean", "lamb flatbread"),
               ("Kettle & Crumb", "brunch", "ricotta pancakes"), ("Saffron House", "Persian", "jeweled rice"),
               ("El Farolito", "Mexican", "birria tacos"), ("Little Tbilisi", "Georgian", "cheese boat bread")]
CARS = [("Subaru Outback", "forest green"), ("Honda Fit", "bright red"), ("Toyota Prius", "silver"),
        ("Volvo wagon", "navy blue"), ("Mazda 3", "white"), ("Ford Maverick", "orange")]
SNACKS = ["dumplings", "banana bread", "pad thai", "lemon bars", "falafel", "pierogi", "cinnamon rolls"]
CHORES = ["reorganizing the pantry", "doing taxes", "untangling fairy lights", "washing windows", "sorting old photos"]
MOVIES = ["space heist", "haunted lighthouse", "time-loop wedding", "robot detective"]
WEATHERS = ["grey and drizzly", "weirdly warm", "freezing", "so windy", "muggy"]
SHOWS = ["that baking competition", "the new detective series", "a documentary about octopuses",
         "the dragon show everyone talks about", "a Korean drama my cousin recommended", "the hospital comedy"]

# ------------------------------------------------------------------------------------ event kinds
# Each kind: fact turns (owner; {rel} is the relative date, dropped when the event has none), reactions
# (other person; they prompt the detail), detail turns (owner; refer back with a pronoun), questions:
# single (evidence: fact), para (evidence: fact, must share no content root with it), temporal (evidence:
# fact), coref (evidence: fact + detail). Slots: {P} owner, {O} other, {pron}/{poss} owner's pronouns.

KINDS: dict[str, dict[str, list[tuple[str, str]] | list[str]]] = {
    "job": {
        "fact": ["I've been a {job} at {workplace} for {years} years now, and this week was the hardest yet.",
                 "Long week at {workplace}. Being a {job} is no joke sometimes."],
        "react": ["Oh no, what happened?", "Ugh. Want to vent?"],
        "detail": ["Just everything at once. I'm proud of the team though.",
                   "Nothing dramatic, just tired. It helps to talk about it."],
        "single": [("What does {P} do for a living?", "{job}"), ("Where does {P} work?", "{workplace}")],
        "para": [], "temporal": [], "coref": [],
    },
    "pet": {
        "fact": ["Big news: I adopted a {species} {rel}! {Pron} came from {source} and {pron}'s called {pet}.",
                 "So {rel} I brought home a {species} from {source}. Meet {pet}!",
                 "Okay, don't laugh, but there's a {species} living with me now. Got {pet_obj} {rel} from {source}, "
                 "name's {pet}."],
        "react": ["Aww!! What's {pet_pron} like?", "Stop, that's adorable. Is {pet_pron} settling in?",
                  "No way! How's {pet_pron} getting on so far?"],
        "detail": ["{PetPron}'s a menace, honestly. {PetPron} {quirk}.",
                   "Settling in a bit too well. {PetPron} {quirk}."],
        "single": [("What is the name of the {species} {P} adopted?", "{pet}"),
                   ("Where did {P} get {pet}?", "From {source}")],
        "para": [("What is the animal companion that arrived in {month} called?", "{pet}"),
                 ("Which creature joined the {job}'s household in {month}?", "A {species} called {pet}")],
        "temporal": ["When did {P} adopt {pet}?", "When did {pet} the {species} come home with {P}?"],
        "coref": [("What odd habit does {P}'s {species} have?", "{PetPron} {quirk}"),
                  ("What does {pet} do that drives {P} crazy?", "{PetPron} {quirk}")],
    },
    "trip": {
        "fact": ["We got back from {city} {rel}! My {krel} {kin} and I went together.",
                 "Just landed home from {city} {rel}, a whole week with my {krel} {kin}.",
                 "I never told you, my {krel} {kin} and I flew to {city} {rel}. Totally spontaneous."],
        "react": ["Jealous!! What was the best part?", "Oh wow, how was it?", "Ooh, tell me everything."],
        "detail": ["Honestly {highlight}. And {kin} made us eat {food} every single day.",
                   "The best bit was {highlight}. We lived on {food}, no regrets."],
        "single": [("Who did {P} travel to {city} with?", "{P}'s {krel} {kin}"),
                   ("Where did {P} go with {poss} {krel} {kin}?", "{city}")],
        "para": [("Which relative went abroad on holiday in {month}?", "{P}'s {krel} {kin}"),
                 ("Which family member accompanied the {job} on a holiday abroad in {month}?", "{P}'s {krel} {kin}")],
        "temporal": ["When did {P} get back from {city}?", "When did {P} return from the trip to {city}?"],
        "coref": [("What food did {P} keep eating in {city}?", "{food}"),
                  ("What was the highlight of {P}'s trip to {city}?", "{highlight}")],
    },
    "instrument": {
        "fact": ["I finally started {instrument} lessons {rel}. My teacher is {teacher} and {tpron}'s so patient.",
                 "Guess what I signed up for {rel}: {instrument} lessons! {Teacher} is teaching me."],
        "react": ["That's awesome! What are you learning first?", "Ooh fun, how's it going?"],
        "detail": ["We're working on {piece}. My fingers hate me but it's starting to sound like something.",
                   "Right now it's {piece}, very slowly. The neighbors are being good sports."],
        "single": [("What instrument is {P} taking lessons on?", "{instrument}"),
                   ("Who teaches {P} the {instrument}?", "{teacher}")],
        "para": [("Which musical instrument was taken up in {month}?", "The {instrument}"),
                 ("What musical instrument is the {job} studying?", "The {instrument}")],
        "temporal": ["When did {P} start {instrument} lessons?"],
        "coref": [("What piece is {P} practising on the {instrument}?", "{piece}")],
    },
    "promotion": {
        "fact": ["Guess who got promoted {rel}? I'm officially {role} at {workplace}!",
                 "So {rel} my boss pulled me aside at {workplace}... I'm the new {role}!"],
        "react": ["WHAT! Congratulations!! How did they tell you?",
                  "That's huge, you deserve it! How are you feeling?"],
        "detail": ["{boss} told me in a tiny meeting room and I almost cried. There's a pay bump too.",
                   "Nervous, honestly. {boss} broke the news and said I start managing the schedule next month."],
        "single": [("What is {P}'s new position at {workplace}?", "{role}")],
        "para": [("What job title was earned in {month}?", "{role}"),
                 ("What rank did the {job} reach at work?", "{role}")],
        "temporal": ["When did {P} get promoted to {role}?"],
        "coref": [("Who told {P} about the promotion to {role}?", "{boss}")],
    },
    "race": {
        "fact": ["I ran {race} {rel}! Finished in {time}.",
                 "Survived {race} {rel}. Official time: {time}."],
        "react": ["You're a machine! How do you feel?", "Whoa, congrats! Was it as hard as you thought?"],
        "detail": ["My knees are still mad at me, but {kin} was waiting at the finish with a giant sign.",
                   "Brutal last mile. {kin} ran the last stretch next to me, which saved me."],
        "single": [("What was {P}'s finishing time at {race}?", "{time}")],
        "para": [("How quickly was the footrace in {month} completed?", "{time}"),
                 ("How long did the {job} need to complete that footrace?", "{time}")],
        "temporal": ["When did {P} run {race}?"],
        "coref": [("Who supported {P} at the end of {race}?", "{P}'s {krel} {kin}")],
    },
    "book": {
        "fact": ["I just finished {title} by {author} {rel}, couldn't put it down.",
                 "Stayed up way too late {rel} finishing {title}. {author} is a genius."],
        "react": ["Ooh, what's it about?", "I've seen that cover everywhere! Is it good?"],
        "detail": ["It's about {topic}. The ending wrecked me.", "So good. It follows {topic}, you'd love it."],
        "single": [("Which book by {author} did {P} read?", "{title}"), ("Who wrote {title}?", "{author}")],
        "para": [("Which novel was devoured in {month}?", "{title} by {author}"),
                 ("Which novel kept the {job} awake at night?", "{title} by {author}")],
        "temporal": ["When did {P} finish reading {title}?"],
        "coref": [("What is {title}, the book {P} read, about?", "{topic}")],
    },
    "concert": {
        "fact": ["Went to see {band} at {venue} {rel}, it was so loud.",
                 "{band} played {venue} {rel} and I was right up front!"],
        "react": ["Ahh how were they??", "So jealous. Did they play the good stuff?"],
        "detail": ["Incredible. They closed with {song} and the whole crowd sang along.",
                   "Yes! {song} as the encore, I lost my voice."],
        "single": [("Which band did {P} see at {venue}?", "{band}"), ("Where did {P} see {band}?", "{venue}")],
        "para": [("Which group performed live in {month}?", "{band}"),
                 ("Which group did the {job} watch perform live?", "{band}")],
        "temporal": ["When did {P} see {band} live?"],
        "coref": [("Which song did {band} finish with at the show {P} went to?", "{song}")],
    },
    "move": {
        "fact": ["We finally moved into the new place in {hood} {rel}. Boxes everywhere.",
                 "{rel_cap} we got the keys to our apartment in {hood}!"],
        "react": ["Yay! What's it like?", "Finally!! Send pictures. What's your favorite thing about it?"],
        "detail": ["It has {feature}, which I've wanted forever.",
                   "Best part is {feature}. I basically live there now."],
        "single": [("Which neighborhood did {P} move to?", "{hood}")],
        "para": [("Which area became home in {month}?", "{hood}"),
                 ("Where does the {job} reside these days?", "{hood}")],
        "temporal": ["When did {P} move to {hood}?"],
        "coref": [("What does {P}'s new home in {hood} have that {pron} always wanted?", "{feature}")],
    },
    "course": {
        "fact": ["I signed up for a {craft} {ctype} at {studio} {rel}.",
                 "{rel_cap} I went to my first {craft} {ctype} at {studio}. So out of my comfort zone."],
        "react": ["Love that! Did you make anything?", "Ooh how was the first session?"],
        "detail": ["I made {creation}. It's lopsided but I'm weirdly proud of it.",
                   "We made {creation} in the first session, mine looks a bit sad but whatever."],
        "single": [("Where is {P} taking the {craft} {ctype}?", "{studio}")],
        "para": [("Which creative workshop began in {month}?", "{craft}"),
                 ("Which craft is the {job} learning in a workshop?", "{craft}")],
        "temporal": ["When did {P} start the {craft} {ctype}?"],
        "coref": [("What did {P} make in {poss} first {craft} session?", "{creation}")],
    },
    "volunteer": {
        "fact": ["{rel_cap} I started volunteering at {charity}, {activity}.",
                 "I've been volunteering at {charity} since {rel}. Mostly {activity}."],
        "react": ["That's so lovely. How did you get into it?", "Aw, that suits you. Is it tiring?"],
        "detail": ["My {krel} {kin} talked me into it, and now I'm hooked.",
                   "A bit, but my {krel} {kin} got me into it and comes along, so the morning flies by."],
        "single": [("Where does {P} volunteer?", "{charity}")],
        "para": [("Which charity has been getting spare hours since {month}?", "{charity}"),
                 ("Which charity does the {job} give unpaid hours to?", "{charity}")],
        "temporal": ["When did {P} start volunteering at {charity}?"],
        "coref": [("Who got {P} into volunteering at {charity}?", "{P}'s {krel} {kin}")],
    },
    "gift": {
        "fact": ["My {krel} {kin} gave me {gift} for my {occasion} {rel}, I teared up.",
                 "{rel_cap} was my {occasion} and {kin}, my {krel}, surprised me with {gift}."],
        "react": ["That's so thoughtful! Where did {kpron} even find that?", "Aww, what a sweet thing to do."],
        "detail": ["Apparently {kpron} hunted for it for months at flea markets.",
                   "{Kpron} found it at a flea market, said it reminded {kobj} of our grandpa. I keep it by the door."],
        "single": [("What did {kin} give {P}?", "{gift}")],
        "para": [("Which present from a family member arrived in {month}?", "{gift}"),
                 ("What present did the {job} receive from a relative?", "{gift}")],
        "temporal": ["When did {P} get {gift} from {kin}?"],
        "coref": [("Where did {kin} find the {gift_bare} for {P}?", "At a flea market")],
    },
    "injury": {
        "fact": ["Ugh, I sprained my {part} {rel} {cause}.", "Small disaster: I hurt my {part} {rel} {cause}."],
        "react": ["Oh no! Are you okay??", "Ouch! Did you see a doctor?"],
        "detail": ["I'll live. The doctor said two weeks in a brace and no heroics.",
                   "It's fine, just swollen. The doctor said two weeks in a brace, so I'm stuck on the couch "
                   "watching {show}."],
        "single": [("How did {P} hurt {poss} {part}?", "By {cause}")],
        "para": [("What mishap caused an injury in {month}?", "{cause}"),
                 ("What accident left the {job} injured?", "{cause}")],
        "temporal": ["When did {P} sprain {poss} {part}?"],
        "coref": [("What did the doctor tell {P} after {pron} sprained {poss} {part}?", "Two weeks in a brace")],
    },
    "restaurant": {
        "fact": ["We tried {restaurant} {rel}, the {dish} was unreal.",
                 "If you're ever near downtown, go to {restaurant}. Had the {dish} there {rel}."],
        "react": ["Adding it to my list! Who did you go with?", "Ooh, was it busy?"],
        "detail": ["My {krel} {kin} picked it, {kpron} knows the owner. We'll definitely go back.",
                   "Packed, but {kin} had booked ahead. That place is a gem."],
        "single": [("Which dish did {P} love at {restaurant}?", "The {dish}")],
        "para": [("Which meal impressed at the {cuisine} eatery?", "The {dish}"),
                 ("What did the {job} rave about eating at the {cuisine} eatery?", "The {dish}")],
        "temporal": ["When did {P} eat at {restaurant}?"],
        "coref": [("Who did {P} go to {restaurant} with?", "{P}'s {krel} {kin}")],
    },
    "car": {
        "fact": ["We bought a used {car} {rel}! It's {color}, you can't miss it.",
                 "{rel_cap} I finally traded in the old car for a {color} {car}."],
        "react": ["Nice! Road trip?", "Ooh fancy. How does it drive?"],
        "detail": ["Smooth! First thing we did was drive it to the coast with {kin}.",
                   "Like a dream. {kin} rode along on the first drive and already wants to borrow it."],
        "single": [("What car did {P} buy?", "{a_color} {car}"), ("What color is {P}'s {car}?", "{color}")],
        "para": [("Which vehicle was purchased in {month}?", "{a_color} {car}"),
                 ("What vehicle did the {job} purchase?", "{a_color} {car}")],
        "temporal": ["When did {P} buy the {car}?"],
        "coref": [("Who was first to ride in {P}'s {car}?", "{kin}")],
    },
}
SHARED_KINDS = ["pet", "trip", "book", "concert", "restaurant", "instrument"]
OWN_KINDS = ["promotion", "race", "move", "course", "volunteer", "gift", "injury", "car"]

# ------------------------------------------------------------------------------------ chatter

GREET = ["Hey {O}! How's your week going?", "Hi {O}, long time no talk!", "Morning {O}! Got a minute?",
         "{O}! I was just thinking about you.", "Hey hey, {O}. Happy {weekday}!",
         "Hi! Sorry I went quiet, work was nuts."]
GREET_BACK = ["Hey {P}! Good to hear from you.", "Hi! I'm good, a bit tired. You?", "Always! What's up?",
              "Ha, same here. How are things?", "Hi {P}! Just got home, perfect timing.",
              "Hey you! All good here."]
REACTIONS = ["That's awesome!", "No way!!", "Wow, I'm so happy for you.", "Haha, love that.", "Amazing.",
             "That sounds incredible.", "Oh that's so cool.", "I can totally picture it.", "Good for you, honestly.",
             "You always find the best stuff.", "Haha, of course.", "I love that for you."]
SMALLTALK = [
    ["Have you been watching {show}?", "Not yet, is it worth it?", "Totally, the second episode especially.",
     "Okay, it's on my list."],
    ["The weather has been so weird lately.", "Right? Sunny one minute, pouring the next.",
     "I've given up on planning anything outdoors."],
    ["I've had the busiest {weekday}.", "Oof, what happened?", "Just meetings on meetings. Nothing exciting.",
     "Those days are the worst."],
    ["Did you sleep okay? You sounded tired last time.", "Not great, but better this week.",
     "Good. Take it easy, okay?"],
    ["What are you up to this weekend?", "No plans, which is kind of the plan.", "Honestly, that sounds perfect."],
    ["I tried a new coffee place near work.", "Any good?", "Decent. The cinnamon thing was too sweet though."],
    ["I keep meaning to call you and then the day disappears.", "Same! Texting counts, right?", "It totally counts."],
    ["How's work treating you?", "Busy but fine. Same old.", "Same old is underrated."],
    ["I cleaned out my closet finally.", "Ooh, find anything good?", "Mostly socks without partners, haha."],
    ["I'm so ready for a long weekend.", "Counting the days over here too."],
    ["Do you still have that plant I gave you?", "Barely alive, but yes!", "Ha, that counts as a win."],
    ["I finally tried making {snack} at home.", "How did it turn out?", "Edible! Mostly.", "That's a win in my book."],
    ["Spent the whole evening {chore}.", "Ugh, the glamorous life.", "Tell me about it."],
    ["Did you see that {movie} movie?", "Not yet, no spoilers please!", "My lips are sealed."],
    ["It's been {weather} all week here.", "Same here, I'm over it.", "Bring on the next season."],
    ["Random question: coffee or tea today?", "Tea, I'm trying to be good.", "Coffee. I'm not trying."],
    ["My phone died in the middle of {chore}.", "Classic.", "Honestly, it was a sign to stop."],
    ["I need a vacation from my vacation brain.", "Haha, what does that even mean?", "No idea. I'm tired."],
    ["Have you had {snack} from that stand by the station?", "Once! It was so good.",
     "I think about it more than I should."],
    ["I started a puzzle and now I can't stop.", "How many pieces?", "A thousand. Send help."],
    ["Work lunch was {snack} again.", "At least it's consistent?", "Ha, that's one word for it."],
    ["I'm trying to drink more water.", "How's that going?", "I have a big bottle and a guilty conscience."],
    ["Do you ever just sit in the car for ten minutes before going inside?", "Every single day.",
     "Glad it's not just me."],

    ["I made soup for the whole week.", "Meal prep queen.", "More like too lazy to cook every night."],
]
# Chatter on the same topics as the events (animals, travel, music, food, races, moves), about nobody's
# event in particular: it answers no question but looks like the turns that do.
TOPICAL = [
    ["My coworker just got a {species2} and won't stop showing me pictures.",
     "Ha, those pictures are the best part of any workday.", "True, I'm not complaining."],
    ["There's a {species2} in my building that sits in the window every morning.", "Do you say hi?",
     "Every day. We're close now."],
    ["My {krel} keeps sending me flight deals to places I can't afford.", "Ha, anything good?",
     "A beach somewhere. I didn't even open it."],
    ["Everyone at work is traveling this month except me.", "Your turn will come!", "It better."],
    ["I had the worst takeout last night, soggy noodles everywhere.", "Nooo. Where from?",
     "Some new place downtown. Never again."],
    ["I started a new book but I'm not into it yet.", "Give it fifty pages.", "That's my rule too."],
    ["Someone was playing {instrument2} outside the station today.", "Any good?",
     "Honestly better than half the radio."],
    ["Have you ever done a {craft2} class? My coworker keeps inviting me.", "Never! You should go.",
     "Maybe. It's on Thursdays, which is rough."],
    ["Our team lunch was at a {cuisine2} place, I ate way too much.", "The best kind of lunch.",
     "Then I napped at my desk. Kidding. Mostly."],
    ["My {krel} wants to sign us up for a race next spring.", "Are you going to?", "If there's brunch after, maybe."],
    ["A moving truck was on my street all day, someone new moved in.", "Ooh, new neighbors!",
     "They have a drum kit. We'll see."],
    ["Did you hear the concert series in the park is back?", "No! When?", "Fridays all summer, I think."],
    ["My car made a horrible noise this morning.", "Uh oh. Mechanic?", "Tomorrow. Wish me luck."],
    ["I keep seeing ads for language apps, maybe it's a sign.", "Which language?",
     "No idea yet. Something for the next trip, whenever that is."],
    ["The dog next door figured out how to open the gate again.", "Oh no, did it get far?",
     "Just to our porch. It wanted snacks."],
    ["Do you ever replay old voice notes from your family?", "All the time, they make me cry.",
     "Same. My {krel} sends the longest ones."],
]
SIDE_REMARKS = ["Anyway, work has been chaos, but that's nothing new.", "I still can't believe it, honestly.",
                "Sorry, I'm rambling.", "It's been a week, let me tell you.",
                "Remind me to tell you about my neighbor later.",
                "I'm trying to say yes to more things this year.", "My phone is full of photos now, I'll send some.",
                "Also I've had three coffees, so excuse the typing."]
CALLBACKS = {  # kind -> (opener by the other person, answer by the owner); {x} is an earlier entity of the owner
    "pet": [("How's {x} doing these days?", "{x} is good! Getting big."),
            ("Give {x} a scratch from me!", "Will do, haha.")],
    "instrument": [("Still practising the {x}?", "Trying to! Some weeks more than others."),
                   ("How's the {x} going?", "Slowly. Very slowly.")],
    "move": [("Are you settled in {x} yet?", "Almost, two boxes left."), ("How's life in {x}?", "Quiet. I like it.")],
    "car": [("Still loving the {x}?", "Honestly yes, best decision this year.")],
}
BACKCHANNEL = ["Mm-hm.", "Haha yeah.", "Totally.", "Right?", "Oh?", "Ha, fair."]
BRIDGE = ["So what's new with you?", "Anyway, enough about me. Anything new with you?", "What have you been up to?",
          "Tell me something good.", "How about you, any news?"]
CLOSE = ["Anyway, I've got to run. Talk soon!", "Okay, dinner's ready. Bye!", "Gotta go, but this was great.",
         "Let's catch up again soon, okay?", "Alright, early shift tomorrow. Night!"]
CLOSE_BACK = ["Bye! Take care.", "Talk soon!", "Night night!", "Definitely. Miss you!", "Go go go, talk later!"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]

# ------------------------------------------------------------------------------------ relative dates


def _fmt(d: datetime) -> str:
    return f"{d.day} {d:%B %Y}"


def relative(rng: random.Random, date: datetime) -> tuple[str, str, datetime]:
    """A relative time phrase, what it means given the session ``date`` (the answer to "when"), and a
    day inside the period it names."""
    choice = rng.choice(["yesterday", "two days ago", "this morning", "last weekend", "last week", "weekday",
                         "last month", "yesterday"])
    if choice == "yesterday":
        return "yesterday", _fmt(date - timedelta(days=1)), date - timedelta(days=1)
    if choice == "two days ago":
        return "two days ago", _fmt(date - timedelta(days=2)), date - timedelta(days=2)
    if choice == "this morning":
        return "this morning", _fmt(date), date
    if choice == "last weekend":
        back = (date.weekday() - 5) % 7 or 7  # days back to the previous Saturday
        return "last weekend", f"the weekend of {_fmt(date - timedelta(days=back))}", date - timedelta(days=back)
    if choice == "last week":
        return "last week", f"the week before {_fmt(date)}", date - timedelta(days=7)
    if choice == "last month":
        first = date.replace(day=1) - timedelta(days=1)
        return "last month", f"{first:%B %Y}", first
    back = rng.randint(2, 6)
    day = date - timedelta(days=back)
    return f"last {WEEKDAYS[day.weekday()]}", _fmt(day), day


# ------------------------------------------------------------------------------------ building


@dataclass
class Event:
    kind: str
    owner: Person
    other: Person
    slots: dict[str, str]
    session: int = -1
    fact_id: str = ""
    detail_id: str = ""
    when: str = ""  # answer to "when", empty when the fact has no relative date


@dataclass
class Conversation:
    index: int
    a: Person
    b: Person
    turns: list[dict[str, object]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    session_dates: list[datetime] = field(default_factory=list)


def _fill(template: str, slots: dict[str, str]) -> str:
    text = template.format(**slots)
    text = re.sub(r" +([,.!?:])", r"\1", re.sub(r"  +", " ", text)).strip()
    return text[0].upper() + text[1:]


class Pools:
    """Draw slot values without repeats within one conversation."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.used: dict[int, list[object]] = {}

    def take(self, pool: list[object]) -> object:
        used = self.used.setdefault(id(pool), [])
        free = [x for x in pool if x not in used] or pool
        pick = self.rng.choice(free)
        used.append(pick)
        return pick


def _slots(kind: str, owner: Person, other: Person, pools: Pools, rng: random.Random) -> dict[str, str]:
    krel, kin = rng.choice(owner.kin)
    kpron = "she" if kin in {"Anjali", "Lakshmi", "Tilly", "Lucia", "Carmen", "Rosa", "Hannah", "Emiko", "Noriko",
                             "Freja", "Bea", "Graça", "Layla", "Fiona", "Isla", "Keisha", "Amara", "Loretta"} else "he"
    s: dict[str, str] = {"P": owner.name, "O": other.name, "pron": owner.pron, "Pron": owner.pron.capitalize(),
                         "poss": owner.poss, "krel": krel, "kin": kin, "kpron": kpron, "Kpron": kpron.capitalize(),
                         "kobj": "her" if kpron == "she" else "him", "workplace": owner.workplace, "role": owner.role,
                         "show": str(rng.choice(SHOWS)), "job": owner.job, "years": str(rng.randint(3, 12))}
    if kind == "pet":
        s["species"] = str(pools.take(SPECIES))  # type: ignore[arg-type]
        s["pet"] = str(pools.take(PET_NAMES))  # type: ignore[arg-type]
        s["source"] = str(pools.take(PET_SOURCES))  # type: ignore[arg-type]
        s["quirk"] = str(pools.take(QUIRKS))  # type: ignore[arg-type]
        she = rng.random() < 0.5
        s["pet_pron"], s["pet_obj"] = ("she", "her") if she else ("he", "him")
        s["PetPron"] = s["pet_pron"].capitalize()
        s["Pron"] = s["PetPron"]
        s["pron"] = s["pet_pron"]
    elif kind == "trip":
        s["city"] = str(pools.take(CITIES))  # type: ignore[arg-type]
        s["highlight"] = str(pools.take(HIGHLIGHTS))  # type: ignore[arg-type]
        s["food"] = str(pools.take(FOODS))  # type: ignore[arg-type]
    elif kind == "instrument":
        s["instrument"] = str(pools.take(INSTRUMENTS))  # type: ignore[arg-type]
        teacher = str(pools.take(TEACHERS))  # type: ignore[arg-type]
        s["teacher"], s["Teacher"] = teacher, teacher[0].upper() + teacher[1:]
        s["tpron"] = "she" if teacher.startswith(("Ms", "Mrs", "Beatriz")) else "he"
        s["piece"] = str(pools.take(PIECES))  # type: ignore[arg-type]
    elif kind == "promotion":
        s["boss"] = str(rng.choice(["My boss Harriet", "Dr. Mensah", "Gloria from HR", "Mr. Feldman",
                                    "Our director, Paulo"]))
    elif kind == "race":
        s["race"] = str(pools.take(RACES))  # type: ignore[arg-type]
        s["time"] = str(pools.take(RACE_TIMES))  # type: ignore[arg-type]
    elif kind == "book":
        s["title"], s["author"], s["topic"] = pools.take(BOOKS)  # type: ignore[arg-type, misc]
    elif kind == "concert":
        s["band"] = str(pools.take(BANDS))  # type: ignore[arg-type]
        s["venue"] = str(pools.take(VENUES))  # type: ignore[arg-type]
        s["song"] = str(pools.take(SONGS))  # type: ignore[arg-type]
    elif kind == "move":
        s["hood"] = str(pools.take(HOODS))  # type: ignore[arg-type]
        s["feature"] = str(pools.take(FEATURES))  # type: ignore[arg-type]
    elif kind == "course":
        s["craft"], s["ctype"], s["creation"] = pools.take(COURSES)  # type: ignore[arg-type, misc]
        s["studio"] = str(pools.take(STUDIOS))  # type: ignore[arg-type]
    elif kind == "volunteer":
        s["charity"], s["activity"] = pools.take(CHARITIES)  # type: ignore[arg-type, misc]
    elif kind == "gift":
        s["gift"] = str(pools.take(GIFTS))  # type: ignore[arg-type]
        s["gift_bare"] = s["gift"].split(" ", 1)[1]
        s["occasion"] = str(rng.choice(OCCASIONS))
    elif kind == "injury":
        s["part"] = str(pools.take(PARTS))  # type: ignore[arg-type]
        s["cause"] = str(pools.take(CAUSES))  # type: ignore[arg-type]
    elif kind == "restaurant":
        s["restaurant"], s["cuisine"], s["dish"] = pools.take(RESTAURANTS)  # type: ignore[arg-type, misc]
    elif kind == "car":
        s["car"], s["color"] = pools.take(CARS)  # type: ignore[arg-type, misc]
        s["a_color"] = ("an " if s["color"][0] in "aeiou" else "a ") + s["color"]
    return s


def _events(conv: Conversation, rng: random.Random) -> list[Event]:
    pools = Pools(rng)
    events: list[Event] = []
    own = OWN_KINDS[:]
    rng.shuffle(own)
    for i, (owner, other) in enumerate(((conv.a, conv.b), (conv.b, conv.a))):
        kinds = ["job", *SHARED_KINDS, "trip"]  # two trips each
        kinds += ["pet"] if i == conv.index % 2 else []  # one of the two has two pets
        kinds += ["book"] if rng.random() < 0.5 else ["concert"]
        kinds += own[i * 4 : i * 4 + 4]
        for kind in kinds:
            events.append(Event(kind, owner, other, _slots(kind, owner, other, pools, rng)))
    return events


def _place(events: list[Event], n_sessions: int, rng: random.Random) -> None:
    """Spread events over sessions: one to three per session, each session at least one; the same
    person's look-alike events (two trips, two pets) at least three sessions apart."""
    order = events[:]
    while True:
        rng.shuffle(order)
        slots = sorted(rng.sample(range(len(order) - 1), n_sessions - 1))
        sessions = [0] * len(order)
        s = 0
        for i in range(len(order)):
            sessions[i] = s
            if s < n_sessions - 1 and i == slots[s]:
                s += 1
        counts = [sessions.count(k) for k in range(n_sessions)]
        if max(counts) > 3:
            continue
        ok = all(k <= 2 for e, k in zip(order, sessions, strict=True) if e.kind == "job")  # jobs come up early
        for i, e in enumerate(order):
            for j, f in enumerate(order):
                if i < j and e.owner is f.owner and e.kind == f.kind and abs(sessions[i] - sessions[j]) < 3:
                    ok = False
        if ok:
            for e, k in zip(order, sessions, strict=True):
                e.session = k
            return


def build_conversation(index: int, rng: random.Random) -> Conversation:
    a_spec, b_spec = PEOPLE[index - 1]
    conv = Conversation(index, Person(*a_spec[:5], kin=list(a_spec[5])), Person(*b_spec[:5], kin=list(b_spec[5])))
    n_sessions = rng.randint(18, 22)
    conv.events = _events(conv, rng)
    _place(conv.events, n_sessions, rng)
    date = datetime(2023, rng.randint(1, 6), rng.randint(1, 28), rng.randint(8, 21), rng.choice([0, 15, 30, 45]))
    mentioned: dict[str, list[tuple[str, str]]] = {conv.a.name: [], conv.b.name: []}  # for callbacks
    for s in range(n_sessions):
        conv.session_dates.append(date)
        target = rng.randint(18, 26)
        turns: list[tuple[str, str, str]] = []  # (speaker, text, role) role: event key or ""
        first, second = (conv.a, conv.b) if rng.random() < 0.5 else (conv.b, conv.a)
        base = {"P": first.name, "O": second.name, "weekday": WEEKDAYS[date.weekday()]}

        def say(who: Person, text: str, role: str = "", turns: list[tuple[str, str, str]] = turns) -> None:
            if turns and turns[-1][0] == who.name:  # keep the two speakers alternating
                other = conv.b if who is conv.a else conv.a
                turns.append((other.name, rng.choice(BRIDGE if role.startswith("fact") else BACKCHANNEL), ""))
            turns.append((who.name, text, role))

        say(first, _fill(rng.choice(GREET), base))
        say(second, _fill(rng.choice(GREET_BACK), base))
        todays = [e for e in conv.events if e.session == s]
        blocks: list[object] = [*todays]
        n_filler = max(1, (target - 4 - 4 * len(todays)) // 3)
        talk = rng.sample(SMALLTALK, len(SMALLTALK))  # nothing said twice in one session
        topical = rng.sample(TOPICAL, len(TOPICAL))
        blocks += ["talk"] * n_filler
        rng.shuffle(blocks)
        for block in blocks:
            if isinstance(block, Event):
                e = block
                slots = dict(e.slots)
                kind = KINDS[e.kind]
                template = str(rng.choice(kind["fact"]))
                day, rel = date, ""
                if "{rel" in template and rng.random() < 0.85:
                    rel, e.when, day = relative(rng, date)
                slots["rel"] = rel
                e.slots["month"] = f"{day:%B %Y}"  # when it happened, for questions that must tell two apart
                slots["rel_cap"] = rel.capitalize() if rel else "Recently"
                fact = _fill(template, slots)
                if rng.random() < 0.3:
                    fact = rng.choice(["Oh! I forgot to tell you. ", "Okay, update. ", "Random update: ", "Ha! "]) \
                        + fact
                if rng.random() < 0.4:
                    fact += " " + rng.choice(SIDE_REMARKS)
                say(e.owner, fact, f"fact:{id(e)}")
                say(e.other, _fill(rng.choice(kind["react"]), slots))  # type: ignore[arg-type]
                detail = _fill(rng.choice(kind["detail"]), slots)  # type: ignore[arg-type]
                if rng.random() < 0.3:
                    detail += " " + rng.choice(SIDE_REMARKS)
                say(e.owner, detail, f"detail:{id(e)}")
                say(e.other, rng.choice(REACTIONS))
                key = {"pet": "pet", "instrument": "instrument", "move": "hood", "car": "car"}.get(e.kind)
                if key:
                    mentioned[e.owner.name].append((e.kind, e.slots[key]))
            else:
                speaker = rng.choice([conv.a, conv.b])
                listener = conv.b if speaker is conv.a else conv.a
                known = mentioned[listener.name]
                if known and rng.random() < 0.3:
                    kind_x, x = rng.choice(known)
                    ask, answer = rng.choice(CALLBACKS[kind_x])
                    say(speaker, _fill(ask, {"x": x}))
                    say(listener, _fill(answer, {"x": x}))
                else:
                    lines = talk.pop() if rng.random() < 0.5 or not topical else topical.pop()
                    fill = {"species2": rng.choice(SPECIES), "instrument2": rng.choice(INSTRUMENTS),
                            "craft2": rng.choice(COURSES)[0], "cuisine2": rng.choice(RESTAURANTS)[1],
                            "krel": rng.choice(speaker.kin)[0], "show": rng.choice(SHOWS),
                            "weekday": WEEKDAYS[date.weekday()], "snack": rng.choice(SNACKS),
                            "chore": rng.choice(CHORES), "movie": rng.choice(MOVIES), "weather": rng.choice(WEATHERS)}
                    who = speaker
                    for line in lines:
                        say(who, _fill(line, fill))
                        who = listener if who is speaker else speaker
        last = conv.a if turns[-1][0] == conv.b.name else conv.b
        say(last, rng.choice(CLOSE))
        say(conv.b if last is conv.a else conv.a, rng.choice(CLOSE_BACK))
        for t, (speaker, text, role) in enumerate(turns, 1):
            mid = f"c{index}-s{s + 1:02d}-t{t:02d}"
            if role:
                part, _, key = role.partition(":")
                ev = next(e for e in conv.events if str(id(e)) == key)
                if part == "fact":
                    ev.fact_id = mid
                else:
                    ev.detail_id = mid
            conv.turns.append({
                "kind": "memory", "org_id": ORG, "agent_id": f"conv-{index}", "memory_id": mid,
                "content": f"{speaker}: {text}", "category": "note", "confidence": 0.8,
                "created_at": (date + timedelta(seconds=20 * t)).strftime("%Y-%m-%dT%H:%M:%S+00:00"),
            })
        date = date + timedelta(days=rng.randint(3, 34), hours=rng.randint(-5, 5), minutes=rng.choice([0, 10, 25, 40]))
        date = date.replace(hour=min(21, max(7, date.hour)))
    if len(conv.turns) < MIN_TURNS:
        raise RuntimeError(f"conversation {index}: {len(conv.turns)} turns, fewer than {MIN_TURNS}")
    return conv


# ------------------------------------------------------------------------------------ questions


def _q(conv: Conversation, category: str, question: str, answer: str, evidence: list[str]) -> dict[str, object]:
    return {"conversation": conv.index, "org_id": ORG, "agent_id": f"conv-{conv.index}", "category": category,
            "question": question, "answer": answer, "evidence": evidence}


def _content(conv: Conversation, mid: str) -> str:
    return str(next(t["content"] for t in conv.turns if t["memory_id"] == mid))


def questions_for(conv: Conversation, rng: random.Random) -> list[dict[str, object]]:
    cands: dict[str, list[dict[str, object]]] = {c: [] for c in QUOTA}
    for e in conv.events:
        kind = KINDS[e.kind]
        s = dict(e.slots)
        for q, a in kind["single"]:  # type: ignore[misc]
            cands["single-hop"].append(_q(conv, "single-hop", _fill(q, s), _fill(a, s), [e.fact_id]))
        for q, a in kind["para"]:  # type: ignore[misc]
            text = _fill(q, s)
            if not content_roots(text) & content_roots(_content(conv, e.fact_id)):
                cands["paraphrased"].append(_q(conv, "paraphrased", text, _fill(a, s), [e.fact_id]))
        if e.when:
            q = rng.choice(kind["temporal"])  # type: ignore[arg-type]
            cands["temporal"].append(_q(conv, "temporal", _fill(str(q), s), e.when, [e.fact_id]))
        for q, a in kind["coref"]:  # type: ignore[misc]
            cands["multi-hop"].append(_q(conv, "multi-hop", _fill(q, s), _fill(a, s), [e.fact_id, e.detail_id]))
    # Across sessions: both of a person's trips and pets, and which of two events came first.
    pairs: list[dict[str, object]] = []
    for person in (conv.a, conv.b):
        mine = [e for e in conv.events if e.owner is person]
        trips = sorted((e for e in mine if e.kind == "trip"), key=lambda e: e.session)
        pets = sorted((e for e in mine if e.kind == "pet"), key=lambda e: e.session)
        if len(trips) == 2:
            pairs.append(_q(conv, "multi-hop", f"Which cities has {person.name} traveled to?",
                            f"{trips[0].slots['city']} and {trips[1].slots['city']}",
                            [trips[0].fact_id, trips[1].fact_id]))
            pairs.append(_q(conv, "multi-hop", f"Who went with {person.name} on each of {person.poss} two trips?",
                            f"{trips[0].slots['kin']} to {trips[0].slots['city']}, {trips[1].slots['kin']} to "
                            f"{trips[1].slots['city']}", [trips[0].fact_id, trips[1].fact_id]))
        if len(pets) == 2:
            pairs.append(_q(conv, "multi-hop", f"What are the names of {person.name}'s two pets?",
                            f"{pets[0].slots['pet']} and {pets[1].slots['pet']}", [pets[0].fact_id, pets[1].fact_id]))
        ordered = [e for e in mine if e.kind in {"pet", "trip", "move", "race", "promotion", "course", "car"}]
        for _ in range(3):
            e1, e2 = sorted(rng.sample(ordered, 2), key=lambda e: e.session)
            if e1.session == e2.session:
                continue
            label = {"pet": "adopting {pet}", "trip": "the trip to {city}", "move": "moving to {hood}",
                     "race": "running {race}", "promotion": "becoming {role}", "course": "starting the {craft} {ctype}",
                     "car": "buying the {car}"}
            x, y = (e1, e2) if rng.random() < 0.5 else (e2, e1)
            lx, ly = label[x.kind].format(**x.slots), label[y.kind].format(**y.slots)
            pairs.append(_q(conv, "multi-hop", f"Which came first for {person.name}: {lx} or {ly}?",
                            label[e1.kind].format(**e1.slots), [x.fact_id, y.fact_id]))
    both_pets = [e for e in conv.events if e.kind == "pet"]
    pairs.append(_q(conv, "multi-hop", f"What kinds of animals do {conv.a.name} and {conv.b.name} have between them?",
                    ", ".join(e.slots["species"] for e in both_pets), [e.fact_id for e in both_pets]))
    # No answer: an absent pet, city, instrument or relative, or an event only the other person had.
    used_species = {e.slots["species"] for e in both_pets}
    used_cities = {e.slots["city"] for e in conv.events if e.kind == "trip"}
    used_instruments = {e.slots["instrument"] for e in conv.events if e.kind == "instrument"}
    none: list[dict[str, object]] = []
    for person in (conv.a, conv.b):
        other = conv.b if person is conv.a else conv.a
        sp = rng.choice([x for x in ABSENT_SPECIES if x not in used_species])
        city = rng.choice([x for x in ABSENT_CITIES if x not in used_cities])
        inst = rng.choice([x for x in ABSENT_INSTRUMENTS if x not in used_instruments])
        none += [_q(conv, "no-answer", f"What is the name of {person.name}'s {sp}?", "", []),
                 _q(conv, "no-answer", f"When did {person.name} visit {city}?", "", []),
                 _q(conv, "no-answer", f"Who teaches {person.name} to play the {inst}?", "", []),
                 _q(conv, "no-answer", f"What is the name of {person.name}'s brother?", "", [])]
        for e in conv.events:
            if e.owner is other and e.kind in OWN_KINDS:
                s = {**e.slots, "P": person.name, "O": other.name, "poss": person.poss, "pron": person.pron}
                q, _ = KINDS[e.kind]["single"][0]  # type: ignore[misc]
                if e.kind not in {"gift", "volunteer"}:  # their single question names the other's entities
                    none.append(_q(conv, "no-answer", _fill(q, s), "", []))
    cands["multi-hop"] = pairs + cands["multi-hop"]
    cands["no-answer"] = none
    # A question asked twice with different evidence (two look-alike events) has no single answer: drop it.
    seen: dict[str, list[object]] = {}
    for pool in cands.values():
        for q in pool:
            seen.setdefault(str(q["question"]), []).append(q["evidence"])
    for category, pool in cands.items():
        cands[category] = [q for q in pool if len(seen[str(q["question"])]) == 1]
    pairs = [q for q in pairs if len(seen[str(q["question"])]) == 1]
    out: list[dict[str, object]] = []
    for category, n in QUOTA.items():
        pool = cands[category]
        if len(pool) < n:
            raise RuntimeError(f"conversation {conv.index}: {len(pool)} {category} candidates, need {n}")
        if category == "multi-hop":  # half across sessions, half statement + follow-up
            k = min(len(pairs), n // 2)
            picked = rng.sample(pairs, k) + rng.sample(pool[len(pairs):], n - k)
        else:
            picked = rng.sample(pool, n)
        out += picked
    for i, q in enumerate(out, 1):
        q["id"] = f"c{conv.index}-q{i:03d}"
    return [{"id": q["id"], **{k: v for k, v in q.items() if k != "id"}} for q in out]


# Questions added after the first set, drawn from a random stream of their own per conversation so
# every earlier question and turn stays byte for byte as it was.
EXTRA_QUOTA = {"people": 6, "open-domain": 6}
# Answered by inference from what the owner said (their statement is the evidence); the answer names it.
INFERRED = {
    "pet": ("Does {P} need someone to look after an animal when {pron} goes away?", "Yes: {pet} the {species}"),
    "injury": ("Should {P} have gone easy on sports for a while?", "Yes: a sprained {part}"),
    "car": ("Could {P} drive somewhere instead of taking the bus?", "Yes: {poss} {car}"),
    "course": ("Would supplies for a hobby class make a good present for {P}?", "Yes: the {craft} {ctype}"),
    "book": ("Does {P} enjoy reading novels?", "Yes: {title} by {author}"),
    "instrument": ("Is {P} learning to make music?", "Yes: {instrument} lessons"),
    "race": ("Is {P} into running?", "Yes: {race}"),
    "volunteer": ("Does {P} give {poss} time to a good cause?", "Yes: at {charity}"),
}


def extra_questions(conv: Conversation, first_id: int) -> list[dict[str, object]]:
    """``people`` (how someone the chat names is related to its speaker: the turns saying it are the
    evidence) and ``open-domain`` (answered by inference from a statement) questions."""
    rng = random.Random(SEED * 1_000 + conv.index)
    people: dict[str, dict[str, object]] = {}
    inferred: dict[str, dict[str, object]] = {}
    for e in conv.events:
        s = {**e.slots, "P": e.owner.name, "poss": e.owner.poss, "pron": e.owner.pron}
        kin, krel = s["kin"], s["krel"]
        said = [m for m in (e.fact_id, e.detail_id) if m and kin in _content(conv, m)
                and re.search(rf"\b{krel}\b", _content(conv, m))]
        if said:
            asked = f"How is {kin} related to {e.owner.name}?"
            q = people.setdefault(asked, _q(conv, "people", asked, f"{e.owner.name}'s {krel}", []))
            q["evidence"] = sorted({*q["evidence"], *said})  # type: ignore[misc]
        if e.kind in INFERRED:
            asked, answer = (_fill(t, s) for t in INFERRED[e.kind])
            q = inferred.setdefault(asked, _q(conv, "open-domain", asked, answer, []))
            q["evidence"] = sorted({*q["evidence"], e.fact_id})  # type: ignore[misc]
    out: list[dict[str, object]] = []
    for category, pool in (("people", list(people.values())), ("open-domain", list(inferred.values()))):
        out += rng.sample(pool, min(EXTRA_QUOTA[category], len(pool)))
    for i, q in enumerate(out, first_id):
        q["id"] = f"c{conv.index}-q{i:03d}"
    return [{"id": q["id"], **{k: v for k, v in q.items() if k != "id"}} for q in out]


def generate() -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    rng = random.Random(SEED)
    turns: list[dict[str, object]] = []
    questions: list[dict[str, object]] = []
    for index in range(1, len(PEOPLE) + 1):
        conv = build_conversation(index, rng)
        turns += conv.turns
        mine = questions_for(conv, rng)
        questions += mine + extra_questions(conv, len(mine) + 1)
    return turns, questions


def _jsonl(rows: list[dict[str, object]]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main() -> None:
    turns, questions = generate()
    CONVERSATIONS_FILE.write_text(_jsonl(turns), encoding="utf-8")
    QUESTIONS_FILE.write_text(_jsonl(questions), encoding="utf-8")
    print(f"{len(turns)} turns -> {CONVERSATIONS_FILE.name}, {len(questions)} questions -> {QUESTIONS_FILE.name}")


if __name__ == "__main__":
    main()
