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
    -- Until the next whole token is added; 0 while the bucket is full.
    local function next_token(held)
      if held >= capacity then
        return 0
      end
      return ceil_div(window - (held - floor_div(held, window) * window), limit) + shift
    end
    if tokens >= need then
      local after = tokens - need
      return 1, floor_div(after, window), next_token(after), 0, tokens, last
    end
    local retry = ceil_div(need - tokens, limit) + shift
    return 0, floor_div(tokens, window), next_token(tokens), retry, tokens, last
  end

  local function commit(key, limit, window, now, cost, burst, tokens, last)
    local after = tokens - cost * window
    save(key, last - now + ceil_div(burst * window - after, limit), after, last)
  end

  -- Settles a reservation of `reserved` units taken at `at` to `used`
  -- (algorithms/token_bucket.rs, settle, charge_over): more units come out of
  -- the bucket, and what it cannot pay it owes, counted from a `last` in
  -- the future; unused units go back, at most what has not refilled since.
  local function settle(key, limit, window, now, burst, at, reserved, used)
    if used == reserved then
      return
    end
    local capacity = burst * window
    local _, _, _, _, tokens, last = check(key, limit, window, now, 0, burst)
    if used > reserved then
      tokens = tokens - (used - reserved) * window
      if tokens < 0 then
        local wait = ceil_div(-tokens, limit)
        last = last + wait
        tokens = min(capacity, tokens + wait * limit)
      end
    else
      local give = min((reserved - used) * window, reserved * window - max(now - at, 0) * limit)
      if give <= 0 then
        return
      end
      tokens = min(capacity, tokens + give)
    end
    save(key, last - now + ceil_div(capacity - tokens, limit), tokens, last)
  end

  return check, commit, settle
end
