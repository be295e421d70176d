-- floodgate: the decision as a plain script, run with EVALSHA. floodgate
-- uses it where Redis has no functions (before Redis 7); it loads the
-- algorithms it needs on every call.
return decide(KEYS, ARGV)
