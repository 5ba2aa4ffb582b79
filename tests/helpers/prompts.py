"""The prompts the real-model tests compare Tandem with Hugging Face transformers on."""

PLAIN_PROMPTS = [
    "The history of the printing press began",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Three facts about the planet Mars: 1.",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "user", "content": "Explain in two sentences why the sky is blue, for a child."}],
]
SYSTEM_PROMPT = (
    "You are Tandem's support assistant. You answer questions about distributed systems, "
    "caching, networking and GPUs. Keep answers short, precise and friendly; when a question "
    "is ambiguous, say which reading you chose. Never invent facts; if you do not know, say so."
)
SHARED_PREFIX_CHATS = [
    [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}]
    for q in (
        "What is a cache hit?",
        "Why do GPUs have high memory bandwidth?",
        "What does TCP guarantee?",
        "How does consistent hashing help a cache cluster?",
    )
]
MAX_NEW_TOKENS = 64
# Chats whose answers copy their input (what speculative decoding's model-free proposers draft from).
GROUNDED_CHATS = [
    [{"role": "user", "content": "Repeat this passage exactly:\n\nThe Amazon rainforest covers much of the Amazon "
                                 "basin of South America. This basin encompasses seven million square kilometres, of "
                                 "which five and a half million square kilometres are covered by the rainforest."}],
    [{"role": "user", "content": "Rename the function add to add_numbers in this code and show the whole file:\n\n"
                                 "def add(a, b):\n    return a + b\n\n\ndef main():\n    print(add(2, 3))\n"
                                 "    print(add(10, 20))\n"}],
    [{"role": "user", "content": "Extract the name, age and city from this text as JSON with keys name, age, city: "
                                 "\"My name is Maria Lopez, I am 34 years old and I live in Barcelona.\""}],
]
