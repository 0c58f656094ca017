"""Test prompts written for the suite (not MT-Bench/HumanEval, which are for evaluation)."""

PROMPTS = [
    "Explain how a bicycle gear system works.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between Python lists and tuples?",
    "Give me a recipe for pancakes with step-by-step instructions.",
    "Summarize the water cycle for a ten-year-old.",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "List five tips for getting better sleep.",
    "Describe the city of Paris to someone who has never been there.",
    "Why do leaves change color in autumn?",
    "Write a polite email asking a colleague to review a document.",
    "Explain the difference between weather and climate.",
    "What is photosynthesis? Answer in a paragraph.",
    "Write a poem about the ocean at night.",
    "How does a refrigerator keep food cold?",
    "Give three arguments for and three against working from home.",
    "Explain what a linked list is and when to use one.",
    "Describe a typical day of a farmer in spring.",
    "What should I pack for a weekend camping trip?",
    "Count from one to twenty in words, separated by commas.",
    "Write the alphabet in order, then write it again in reverse order.",
]
