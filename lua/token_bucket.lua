-- floodgate: token bucket.
-- Refills `limit` tokens per `window` continuously (not in whole-second
-- steps), holding at most `burst`. Tokens are counted in unit-milliseconds
-- (one token = `window` of them), so refilling adds exactly `limit` per
-- millisecond and every value is an integer.
-- Key: a hash {t = scaled tokens, l = when t was computed (ms)}. A missing
-- key is a full bucket; the key expires once the bucket is full again.
local token_bucket = {}

-- Scaled tokens available at `now`, and the time they are counted from.
local function available(key, limit, window, burst, now)
  local capacity = burst * window
  local stored = redis.call('HMGET', key, 't', 'l')
  local tokens, last = tonumber(stored[1]), tonumber(stored[2])
  if not tokens or not last then
    return capacity, now
  end
  local elapsed = math.max(now - last, 0)
  if elapsed >= ceil_div(capacity - tokens, limit) then
    tokens = capacity
  else
    tokens = tokens + elapsed * limit
  end
  return tokens, math.max(now, last)
end

function token_bucket.check(key, limit, window, now, cost, burst)
  local capacity = burst * window
  local tokens = available(key, limit, window, burst, now)
  local need = cost * window
  if tokens >= need then
    local after = tokens - need
    return {1, floor_div(after, window), ceil_div(capacity - after, limit), 0}, tokens
  end
  return {0, floor_div(tokens, window), ceil_div(capacity - tokens, limit),
    ceil_div(need - tokens, limit)}, tokens
end

function token_bucket.commit(key, limit, window, now, cost, tokens, burst)
  local _, last = available(key, limit, window, burst, now)
  local after = tokens - cost * window
  redis.call('HSET', key, 't', int(after), 'l', int(last))
  expire(key, last - now + ceil_div(burst * window - after, limit))
end
