"""`h2o-chat serve`: the OpenAI-compatible API, the scheduler and its engine rows, idle conversations."""
