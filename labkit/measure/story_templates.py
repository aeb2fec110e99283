"""The sentence templates of ``labkit.measure.corpus``'s stories: one list per story beat, one plot per kind.

Placeholders such as ``{name}`` or ``{colour_a}`` are filled by ``corpus``; ``@meet`` stands for a sentence
drawn from ``MEETS``. Introduced with the corpus in notebook 01 (``01_anatomy_of_a_request``).
"""

# Story beats: each is a list of sentence templates; one is drawn per beat.
OPENINGS = [
    "Once upon a time, there was {trait_a} {kind} named {name}.",
    "Once upon a time, near {a_place_adj} {place}, there lived {trait_a} {kind} named {name}.",
    "Once upon a time, {trait_a} {kind} named {name} lived {prep} the {place}.",
    "There once was {trait_a} {kind} called {name} who lived {prep} the {place}.",
    "Once upon a time, there was {trait_a} {kind}. {His} name was {name}.",
]
INTROS = [
    "{name} loved to {hobby}.", "{He} liked to {hobby} every day.",
    "{name} had {colour_a} {obj} that {he} loved very much.", "Every day, {name} would {hobby} with {his} mom.",
    "{name} was always {good} when {he} could {hobby}.",
]
MEETS = [
    "There, {he} met {fkind_a} named {fname}.", "{He} saw {fkind_a} named {fname} sitting all alone.",
    "On the way, {he} met {his} friend {fname} the {fkind}.", "Soon, {fname} the {fkind} came to say hello.",
]
PLOTS = {
    "lost": [
        "{time}, {name} went to the {place} with {his} {colour} {obj}.",
        "{He} played all day, but then {he} could not find {his} {obj}!", "{name} felt very {bad}.", "@meet",
        '"Why are you {bad}?" {fname} asked.', '"I lost my {colour} {obj}," {name} {said}.',
        '"Do not worry. I will help you find it," said {fname}.', "They looked {hide}, and they looked {hide2}.",
        "At last, {fname} found the {obj} {hide}!", '"Thank you, {fname}!" said {name}. "You are a good friend."',
    ],
    "friend": [
        "{time}, {name} went to the {place}.", "{He} felt a little {bad} because {he} had no one to play with.",
        "@meet", '"Hello, {fname}!" said {name}. "Do you want to play with me?"',
        '"Yes, I would love to!" {fname} {said}.', "They played {game} and laughed and laughed.",
        "Then they sat down and shared some {snack}.", "{name} was not {bad} anymore.",
    ],
    "share": [
        "{time}, {name} took a basket of {snack} to the {place}.", "@meet",
        "{fname} looked at the {snack} and said, \"Those look very good. Can I have some?\"",
        "At first, {name} did not want to share. {He} wanted all the {snack} for {him}self.",
        "But then {he} saw that {fname} was hungry and {fbad}.", '"Here, {fname}, you can have half," said {name}.',
        "{fname} smiled a big smile. \"Thank you!\"",
        "They ate the {snack} together, and it was more fun than eating alone.",
        "{name} learned that sharing makes everyone {good}.",
    ],
    "brave": [
        "{name} was scared of {fear}.", "{time}, {his} friend {fname} the {fkind} came to visit.",
        '"Let us go to the {place}," said {fname}.', "But on the way, they had to pass {fear}.",
        '"I am too scared," {name} {said}.', '"I will stay with you," said {fname}. "You can do it."',
        "{name} took a deep breath and held {fname}\'s hand.",
        "Step by step, {he} went on, and soon it was behind them.", '"I did it!" {name} shouted.',
        "{He} felt very {good} and brave.",
    ],
    "find": [
        "{time}, {name} was walking {prep} the {place}.", "{He} saw something {colour} {hide}.",
        "It was {a_adj_box} box!", "{name} wanted to know what was inside.",
        "{He} ran to get {his} friend {fname} the {fkind}.", '"Look what I found!" {name} {said}.',
        "Together they opened the box. Inside was {colour_a} {obj}!", '"Wow!" said {fname}. "It is so pretty."',
        "They took turns playing with the {obj} until the sun went down.",
    ],
    "storm": [
        "{time}, {name} and {fname} the {fkind} went to play {prep} the {place}.",
        "They played {game} for a long time.", "Then the sky grew dark, and big drops of rain began to fall.",
        '"Oh no! A storm is coming!" {fname} {said}.', "{fname} felt {fbad}, but {name} had an idea.",
        '"Follow me! We can stay dry {hide}," said {name}.', "They waited and listened to the rain.",
        "Soon the rain stopped, and the sun came out.",
        "In the sky, there was a big rainbow with every colour they knew.",
    ],
    "help": [
        "{time}, {name} heard a small voice {prep} the {place}.", '"Help! Help!" cried the voice.',
        "It was {fname} the {fkind}. {fHis} {stuck} was stuck in a tall tree.", "{fname} was very {fbad}.",
        '"Do not cry," said {name}. "I will help you."', "{name} thought and thought. Then {he} found a long stick.",
        "{He} reached up high and gave the {stuck} a little push.",
        "The {stuck} fell down, right into {fname}\'s arms.", '"Thank you so much!" said {fname}.',
    ],
    "bake": [
        "{time}, {name} wanted to make a cake for {his} mom.", "{He} asked {his} friend {fname} the {fkind} to help.",
        "They got flour, eggs, milk and sugar.", "{fname} put in some {filling}, and {name} stirred and stirred.",
        "Soon there was flour on the floor, on the table and on their noses!", "They laughed and laughed.",
        "When mom came home, she saw the cake and the big mess.", '"We made it for you!" said {name}.',
        "Mom smiled and gave them both a big hug. \"This is the best cake ever,\" she said.",
    ],
    "garden": [
        "{time}, {name} found a tiny seed {hide}.", '"What will you grow into?" {name} asked the seed.',
        "{He} planted it in the soft ground and gave it some water.",
        "Every morning, {he} watered the seed and waited.", "{His} friend {fname} the {fkind} came to watch too.",
        '"Nothing is happening," said {fname}. "Let us wait a little more."',
        "One morning, they saw a small green sprout.", "The sprout grew and grew into a tall {colour} flower.",
        '"It is beautiful!" {name} {said}.', "{name} and {fname} were very {good} that they had been patient.",
    ],
    "party": [
        "Today was {fname}\'s birthday, and {name} wanted to give {fhim} something special.",
        "{name} looked in {his} room and found {his} favourite {obj}.",
        "{He} wrapped it in {colour} paper with a big bow.",
        "At the party, there were balloons, games and a big cake with candles.",
        "Everyone sang a happy birthday song.", "Then {name} gave the present to {fname}.",
        "{fname} opened it and cried, \"{Obj_a}! I always wanted one!\"", "{name} felt warm and {good} inside.",
        "Giving a gift made {him} just as happy as getting one.",
    ],
    "sick": [
        "{time}, {name} learned that {his} friend {fname} the {fkind} was sick in bed.",
        "{name} felt {bad} for {fhim}.", '"What can I do to help?" {name} asked {his} dad.',
        '"You could bring {fhim} some warm soup," said Dad.',
        "So {name} carried a pot of soup and some {snack} to {fname}\'s house.",
        "{He} read {fname} a story and sang a quiet song.", "{fname} smiled for the first time that day.",
        "A few days later, {fname} was well again.", '"Thank you for taking care of me," said {fname}.',
        '"That is what friends are for," {name} {said}.',
    ],
    "wish": [
        "{time}, {name} could not sleep.", "{He} looked out of the window and saw a shooting star.",
        '"I wish I could fly up to the moon," {name} whispered.',
        "Just then, {fname} the {fkind} knocked on the window.",
        '"Come with me," said {fname}. "I know a secret place."',
        "They climbed to the top of the highest hill they could find.",
        "From there, the moon looked so close that {name} could almost touch it.",
        "They counted the stars and made up names for them: Sparkle, Twinkle and Glow.",
        "When the sky turned pink, they walked home slowly.",
        "{name} did not fly to the moon, but it was the best night ever.",
    ],
    "lost_way": [
        "{time}, {name} followed a {colour} butterfly deep into the woods.",
        "When {he} looked around, nothing looked familiar.", '"Where am I?" {name} asked. {He} felt very {bad}.',
        "Then {he} heard someone humming a song.", "It was {fname} the {fkind}, who knew every path in the woods.",
        '"Are you lost?" {fname} asked kindly.', '"Yes, I cannot find my way home," said {name}.',
        '"Follow the river, and you will see your house," said {fname}.',
        "They walked along the river together, past the mushrooms and the mossy rocks.",
        "Soon {name} saw {his} house and {his} mom waving at the door.", "{He} hugged {his} mom and thanked {fname}.",
    ],
    "school": [
        "It was {name}\'s first day at school, and {he} felt {bad}.",
        "{His} tummy felt funny, and {he} could not sit still.", "The teacher, a kind old owl, smiled at everyone.",
        '"Today we will learn to count and to write our names," she said.', "{name} sat next to {fname} the {fkind}.",
        '"I am {bad} too," {fname} whispered.',
        "They helped each other count the apples in the picture: one, two, three, four, five.",
        "Then {name} wrote {his} name in big letters with a {colour} pencil.", '"Well done!" said the teacher.',
        "By lunchtime, {name} was not {bad} anymore. School was fun!",
    ],
}
ENDINGS = [
    "From that day on, {name} and {fname} were best friends.", "{name} went home {good} and tired.",
    "And they lived happily ever after.", "That night, {name} fell asleep with a big smile.",
    "{name} never forgot that day {prep} the {place}.", "The end.",
]
