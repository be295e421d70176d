-- floodgate: decide(KEYS, ARGV) decides one or more requests, each against
-- all limits of its route, one after another. script.lua or library.lua,
-- joined after this file, call it.
--
-- KEYS     the keys of every request's limits, request after request. A
--          request's keys share one hash tag (route and client), so Redis
--          Cluster keeps them in one slot; floodgate sends requests of
--          several clients in one call only to a Redis that is not a
--          cluster.
-- ARGV     per request, in the same order:
--            now in milliseconds, or "" to take it from Redis TIME (always
--              "" in production, so every instance shares Redis's clock;
--              tests pass it to be deterministic)
--            cost: units the request consumes
--            n: how many limits (and keys) the request has
--            then for each of its limits, four arguments: algorithm name,
--              limit, window (ms), burst
--
-- Reply: four integers per limit, request after request, in order:
-- allowed (1/0), remaining, reset_ms, retry_after_ms. For each request,
-- either every limit allowed and consumed the cost, or none consumed
-- anything. A request sees what the requests before it in the same call
-- consumed, exactly as if each had been its own call.
local loaders = {
  fixed_window = fixed_window,
  sliding_log = sliding_log,
  sliding_window = sliding_window,
  token_bucket = token_bucket,
  gcra = gcra,
}

-- The function library (library.lua) loads every algorithm once, when
-- Redis loads the library, and sets this; the plain script (script.lua)
-- leaves it unset and loads the algorithms a call uses, on every call.
local loaded = nil

-- The check and commit functions of algorithm `name`, or nothing.
local function algorithm(name)
  if loaded then
    local pair = loaded[name]
    if pair then
      return pair[1], pair[2]
    end
    return nil
  end
  local load = loaders[name]
  if load then
    return load()
  end
  return nil
end

local function unknown(name)
  return redis.error_reply('floodgate: unknown algorithm ' .. tostring(name))
end

-- Decides one request whose `n` limits have their keys from KEYS[key] and
-- their arguments from ARGV[at], writing its verdicts into `reply` from
-- reply[out]. Returns an error reply, or nothing.
local function decide_one(KEYS, key, ARGV, at, n, now, cost, reply, out)
  -- One limit, the common case: no bookkeeping across limits.
  if n == 1 then
    local check, commit = algorithm(ARGV[at])
    if not check then
      return unknown(ARGV[at])
    end
    local k = KEYS[key]
    local limit, window, burst = tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2]), tonumber(ARGV[at + 3])
    local ok, remaining, reset, retry, a, b = check(k, limit, window, now, cost, burst)
    if ok == 1 then
      commit(k, limit, window, now, cost, burst, a, b)
    end
    reply[out], reply[out + 1], reply[out + 2], reply[out + 3] = ok, remaining, reset, retry
    return nil
  end

  local commits, read_a, read_b, allowed = {}, {}, {}, true
  for i = 1, n do
    local arg, o = at + (i - 1) * 4, out + (i - 1) * 4
    local check
    check, commits[i] = algorithm(ARGV[arg])
    if not check then
      return unknown(ARGV[arg])
    end
    local ok, remaining, reset, retry, a, b = check(KEYS[key + i - 1], tonumber(ARGV[arg + 1]),
      tonumber(ARGV[arg + 2]), now, cost, tonumber(ARGV[arg + 3]))
    read_a[i], read_b[i] = a, b
    reply[o], reply[o + 1], reply[o + 2], reply[o + 3] = ok, remaining, reset, retry
    if ok == 0 then
      allowed = false
    end
  end

  if allowed then
    for i = 1, n do
      local arg = at + (i - 1) * 4
      commits[i](KEYS[key + i - 1], tonumber(ARGV[arg + 1]), tonumber(ARGV[arg + 2]), now, cost,
        tonumber(ARGV[arg + 3]), read_a[i], read_b[i])
    end
  end
  return nil
end

local function decide(KEYS, ARGV)
  local reply = {}
  -- Redis TIME, asked at most once per call: the requests of one call are
  -- decided at one moment.
  local time = nil
  local key, at, last = 1, 1, #ARGV
  while at <= last do
    local now = tonumber(ARGV[at])
    if not now then
      if not time then
        local t = redis.call('TIME')
        time = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
      end
      now = time
    end
    local cost, n = tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2])
    local failed = decide_one(KEYS, key, ARGV, at + 3, n, now, cost, reply, key * 4 - 3)
    if failed then
      return failed
    end
    key = key + n
    at = at + 3 + 4 * n
  end
  return reply
end
