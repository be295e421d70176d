-- floodgate: the decision as a Redis function (Redis 7 and later), run with
-- FCALL. Redis runs this file once, when the library is loaded, so every
-- algorithm is loaded once (the lines floodgate puts before this file set
-- `loaded`, see src/limit/redis/code.rs) instead of on every call. floodgate puts
-- the library's first line (`#!lua name=…`) and FUNCTION_NAME, both
-- carrying a hash of the code, before the other files, so two versions of
-- floodgate sharing a Redis each find their own.
redis.register_function(FUNCTION_NAME, decide)
