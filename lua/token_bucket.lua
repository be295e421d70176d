-- floodgate: token bucket.
-- Refills `limit` tokens per `window` continuously (not in whole-second
-- steps), holding at most `burst`. Tokens are counted in unit-milliseconds
-- (one token = `window` of them), so refilling adds exactly `limit` per
-- millisecond and every value is an integer.
-- Key: "<scaled tokens> <when they were counted (ms)>". A missing key is a
-- full bucket; the key expires once the bucket is full again.
local function token_bucket()
  local function check(key, limit, window, now, cost, burst)
    local capacity = burst * window
    -- Scaled tokens available at `now`, and the time they are counted from.
    local tokens, last = load(key)
    if not tokens or not last then
      tokens, last = capacity, now
    else
      local elapsed = max(now - last, 0)
      if elapsed >= ceil_div(capacity - tokens, limit) then
        tokens = capacity
      else
        tokens = tokens + elapsed * limit
      end
      last = max(now, last)
    end
    -- Tokens are counted at `last`, never before; waits are told from `now`.
    local shift = last - now
    local need = cost * window
    if tokens >= need then
      local after = tokens - need
      local more = 0
      if after < window then
        -- Until the bucket holds one whole token again.
        more = ceil_div(window - after, limit) + shift
      end
      return 1, floor_div(after, window), more, 0, tokens, last
    end
    local retry = ceil_div(need - tokens, limit) + shift
    return 0, floor_div(tokens, window), retry, retry, tokens, last
  end

  local function commit(key, limit, window, now, cost, burst, tokens, last)
    local after = tokens - cost * window
    save(key, last - now + ceil_div(burst * window - after, limit), after, last)
  end

  return check, commit
end
