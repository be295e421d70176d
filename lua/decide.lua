-- floodgate: decide(KEYS, ARGV) decides one request against all limits of
-- its route. script.lua or library.lua, joined after this file, call it.
--
-- KEYS[i]  the key of limit i; all share one hash tag (route and client),
--          so Redis Cluster keeps them in one slot
-- ARGV[1]  now in milliseconds, or "" to take it from Redis TIME (always ""
--          in production, so every instance shares Redis's clock; tests
--          pass it to be deterministic)
-- ARGV[2]  cost: units the request consumes
-- then for each limit i, four arguments: algorithm name, limit, window (ms),
--          burst
--
-- Reply: four integers per limit, in order: allowed (1/0), remaining,
-- reset_ms, retry_after_ms. Either every limit allowed and consumed the
-- cost, or none consumed anything.
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

local function decide(KEYS, ARGV)
  local now = tonumber(ARGV[1])
  if not now then
    local time = redis.call('TIME')
    now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
  end
  local cost = tonumber(ARGV[2])

  -- One limit, the common case: no bookkeeping across limits.
  if #KEYS == 1 then
    local check, commit = algorithm(ARGV[3])
    if not check then
      return redis.error_reply('floodgate: unknown algorithm ' .. tostring(ARGV[3]))
    end
    local limit, window, burst = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
    local ok, remaining, reset, retry, a, b = check(KEYS[1], limit, window, now, cost, burst)
    if ok == 1 then
      commit(KEYS[1], limit, window, now, cost, burst, a, b)
    end
    return {ok, remaining, reset, retry}
  end

  local reply, commits, read_a, read_b, allowed = {}, {}, {}, {}, true
  for i = 1, #KEYS do
    local at = 2 + (i - 1) * 4
    local check
    check, commits[i] = algorithm(ARGV[at + 1])
    if not check then
      return redis.error_reply('floodgate: unknown algorithm ' .. tostring(ARGV[at + 1]))
    end
    local ok, remaining, reset, retry, a, b = check(KEYS[i], tonumber(ARGV[at + 2]),
      tonumber(ARGV[at + 3]), now, cost, tonumber(ARGV[at + 4]))
    read_a[i], read_b[i] = a, b
    reply[at - 1], reply[at], reply[at + 1], reply[at + 2] = ok, remaining, reset, retry
    if ok == 0 then
      allowed = false
    end
  end

  if allowed then
    for i = 1, #KEYS do
      local at = 2 + (i - 1) * 4
      commits[i](KEYS[i], tonumber(ARGV[at + 2]), tonumber(ARGV[at + 3]), now, cost,
        tonumber(ARGV[at + 4]), read_a[i], read_b[i])
    end
  end
  return reply
end
