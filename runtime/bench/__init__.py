"""`blockspec bench`: our methods (`run`) against upstream llama.cpp's own tool (`peers`) on the
same prompts. A front end: may import every room below it."""
