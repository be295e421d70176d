-- floodgate: fixed window.
-- At most `limit` units in each window aligned to multiples of `window`,
-- or, by the calendar, between the boundaries `window` lists (span()).
-- Key: "<window start> <units counted in it>", and " <units granted>"
-- when an operator granted units in that window beyond the limit (grant);
-- it expires when its window ends. A key left from an earlier window reads as empty; a `now` before
-- the key's window (the clock stepped back) is read as that window's start,
-- so the window that was counted is never counted afresh.
local function fixed_window()
  -- The key's count and grant as of the window `t` falls in: its start,
  -- length, count and the units granted in it.
  local function read(key, window, now)
    local s, c, e = load(key)
    -- The window is chosen at `t`, never before the key's; waits are told
    -- from `now`.
    local t = now
    if s and s > now then
      t = s
    end
    local start, len = span(t, window)
    if s == start then
      return start, len, c, e or 0
    end
    return start, len, 0, 0
  end

  -- Reads the key as read() does, inline: every decision runs it, and a
  -- Lua call costs Redis CPU.
  local function check(key, limit, window, now, cost)
    local s, c, e = load(key)
    local t = now
    if s and s > now then
      t = s
    end
    local start, len = span(t, window)
    local count, extra = 0, 0
    if s == start then
      count, extra = c, e or 0
    end
    local reset = start + len - now
    if count + cost <= limit + extra then
      -- More units come only with the next window: `t` is its start.
      return 1, limit + extra - count - cost, reset, 0, count, start, extra
    end
    return 0, limit + extra - count, reset, reset, count, start, extra
  end

  -- The grant, as stored: none is written as nothing.
  local function granted(extra)
    if extra > 0 then
      return extra
    end
    return nil
  end

  local function commit(key, limit, window, now, cost, burst, count, start, extra)
    local _, len = span(start, window)
    save(key, start + len - now, start, count + cost, granted(extra))
  end

  -- Settles a reservation of `reserved` units taken at `at` to `used`
  -- (algorithms.rs, State::settle): more is counted in the current window;
  -- less is given back only while the reservation's window is current.
  local function settle(key, limit, window, now, burst, at, reserved, used)
    local start, len, count, extra = read(key, window, now)
    if used > reserved then
      count = count + used - reserved
    elseif used < reserved and start == span(at, window) then
      count = count - min(reserved - used, count)
    else
      return
    end
    save(key, start + len - now, start, count, granted(extra))
  end

  -- An operator's grant of `units` (State::grant): that many more are
  -- admitted in the current window, past the limit, until it ends.
  local function grant(key, limit, window, now, burst, units)
    local start, len, count, extra = read(key, window, now)
    save(key, start + len - now, start, count, extra + units)
  end

  return check, commit, settle, grant
end
