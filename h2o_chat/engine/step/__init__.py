"""A forward and the loop around it: attention that also returns each key's attention mass (`attention`), the
decode engine that reads prompts in chunks and runs one static step per token (`decode`), its ahead-of-time
compiled CPU program (`compiled`), sampling on the device (`sampling`) and generation as a stream of small
records (`generate`)."""
