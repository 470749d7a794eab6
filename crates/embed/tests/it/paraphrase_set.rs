//! The paraphrase set: 30 facts a user might have said, a question about each in other words,
//! and 30 unrelated sentences among which the facts must be found. Written for the embedders'
//! measurement (README, "Recall by meaning: the embedding model"); not from any eval set.

/// (fact, question about it in other words).
pub const PAIRS: [(&str, &str); 30] = [
    (
        "I drive a silver Volvo.",
        "What kind of automobile do I own?",
    ),
    (
        "My daughter Emma starts kindergarten in September.",
        "When does my kid begin school?",
    ),
    (
        "I'm allergic to peanuts, so keep them out of any recipe.",
        "Which nut makes me sick?",
    ),
    (
        "We moved to Lisbon last spring.",
        "Which city do I live in now?",
    ),
    (
        "My dentist appointment is on Thursday at 3 pm.",
        "When am I seeing the doctor for my teeth?",
    ),
    (
        "I work as a nurse in the night shift at the county hospital.",
        "What is my job?",
    ),
    (
        "Our cat Biscuit is fourteen years old.",
        "How old is the family pet?",
    ),
    (
        "I ran my first marathon in under four hours.",
        "How fast did I finish the long race?",
    ),
    (
        "The wifi password is taped under the router.",
        "Where can I find the network key?",
    ),
    (
        "I prefer tea over coffee in the mornings.",
        "What hot drink do I like to start the day with?",
    ),
    (
        "My brother Tom lives in Toronto and works at a bank.",
        "Where is my sibling based?",
    ),
    (
        "I play the cello in a community orchestra.",
        "Which instrument do I perform with?",
    ),
    (
        "The deploy script fails unless the VPN is connected.",
        "Why does shipping the release break?",
    ),
    (
        "I'm vegetarian and have been for ten years.",
        "Do I eat meat?",
    ),
    (
        "My passport expires in March next year.",
        "When is my travel document no longer valid?",
    ),
    (
        "We are saving for a house with a garden.",
        "What are we putting money aside to buy?",
    ),
    (
        "I broke my left wrist skiing in February.",
        "How did I injure my arm?",
    ),
    (
        "The quarterly report is due to the board on the 30th.",
        "When must the financial summary reach the directors?",
    ),
    (
        "My favourite novel is One Hundred Years of Solitude.",
        "Which book do I love most?",
    ),
    (
        "I take the 7:40 train to the office.",
        "How do I commute to work?",
    ),
    (
        "My grandmother turns ninety in July.",
        "Whose birthday is coming up in the summer?",
    ),
    (
        "I'm learning Japanese on weekday evenings.",
        "Which language am I studying?",
    ),
    (
        "The backup server is in the basement rack, slot four.",
        "Where is the machine that stores copies of our data?",
    ),
    ("I can't stand horror films.", "What movies do I dislike?"),
    (
        "My blood type is O negative.",
        "What kind of blood do I have?",
    ),
    (
        "Our wedding anniversary is the 12th of October.",
        "When did we get married?",
    ),
    (
        "I keep my spare keys with the neighbour at number 9.",
        "Who has a copy of my house keys?",
    ),
    (
        "The staging database is reset every Sunday night.",
        "When is the test data wiped?",
    ),
    (
        "I switched from Android to an iPhone last month.",
        "What phone do I use now?",
    ),
    (
        "My son is afraid of the dark and sleeps with a lamp on.",
        "What frightens my boy at bedtime?",
    ),
];

/// Sentences about none of the above.
pub const DISTRACTORS: [&str; 30] = [
    "The meeting notes were shared in the team channel.",
    "Photosynthesis turns light into chemical energy.",
    "The museum opens at ten on Saturdays.",
    "Please rename the variable to something clearer.",
    "The river flooded the lower fields after the storm.",
    "She painted the fence blue over the weekend.",
    "The invoice template needs a new logo.",
    "Volcanoes can stay dormant for centuries.",
    "He ordered a pizza with extra olives.",
    "The conference was moved online this year.",
    "Bees communicate by dancing.",
    "The printer on the second floor is out of toner.",
    "Our football team lost the final on penalties.",
    "The recipe calls for two cups of flour.",
    "The library extended its opening hours.",
    "Mars has two small moons.",
    "The contract was signed by both parties.",
    "A new bakery opened around the corner.",
    "The function returns an empty list on error.",
    "The hikers reached the summit before noon.",
    "Interest rates rose again this quarter.",
    "The garden hose has a leak near the tap.",
    "The choir rehearses on Tuesday evenings.",
    "Glaciers are retreating in the Alps.",
    "The laptop fan is louder than usual.",
    "Tickets for the concert sold out in minutes.",
    "The bridge will be closed for repairs.",
    "Octopuses have three hearts.",
    "The API rate limit is one hundred requests per minute.",
    "My colleague recommended a podcast about history.",
];

/// Top-1 and top-5 accuracy of `embed` on the set: each question against the facts and the
/// distractors, by cosine.
pub fn accuracy(embed: &dyn Fn(&[&str]) -> Vec<Vec<f32>>) -> (f32, f32) {
    let corpus: Vec<&str> = PAIRS
        .iter()
        .map(|(fact, _)| *fact)
        .chain(DISTRACTORS)
        .collect();
    let questions: Vec<&str> = PAIRS.iter().map(|(_, question)| *question).collect();
    let corpus = embed(&corpus);
    let questions = embed(&questions);
    let (mut top1, mut top5) = (0, 0);
    for (answer, question) in questions.iter().enumerate() {
        let score = |v: &Vec<f32>| -> f32 { v.iter().zip(question).map(|(a, b)| a * b).sum() };
        let mine = score(&corpus[answer]);
        let above = corpus.iter().filter(|v| score(v) > mine).count();
        top1 += usize::from(above == 0);
        top5 += usize::from(above < 5);
    }
    let n = PAIRS.len() as f32;
    (top1 as f32 / n, top5 as f32 / n)
}
