-- floodgate: fixed window.
-- At most `limit` units in each window aligned to multiples of `window`,
-- or, by the calendar, between the boundaries `window` lists (span()).
-- Key: "<window start> <units counted in it>"; it expires when its window
-- ends. A key left from an earlier window reads as empty; a `now` before
-- the key's window (the clock stepped back) is read as that window's start,
-- so the window that was counted is never counted afresh.
local function fixed_window()
  local function check(key, limit, window, now, cost)
    local s, c = load(key)
    -- The window is chosen at `t`, never before the key's; waits are told
    -- from `now`.
    local t = now
    if s and s > now then
      t = s
    end
    local start, len = span(t, window)
    local count = 0
    if s == start then
      count = c
    end
    local reset = start + len - now
    if count + cost <= limit then
      -- More units come only with the next window: `t` is its start.
      return 1, limit - count - cost, reset, 0, count, start, len
    end
    return 0, limit - count, reset, reset, count, start, len
  end

  local function commit(key, limit, window, now, cost, burst, count, start, len)
    save(key, start + len - now, start, count + cost)
  end

  -- Settles a reservation of `reserved` units taken at `at` to `used`
  -- (algorithms.rs, State::settle): more is counted in the current window;
  -- less is given back only while the reservation's window is current.
  -- It reads the key as check does; check keeps its reading inline, as
  -- every decision runs it and a Lua call costs Redis CPU.
  local function settle(key, limit, window, now, burst, at, reserved, used)
    local s, c = load(key)
    local t = now
    if s and s > now then
      t = s
    end
    local start, len = span(t, window)
    local count = 0
    if s == start then
      count = c
    end
    if used > reserved then
      count = count + used - reserved
    elseif used < reserved and start == span(at, window) then
      count = count - min(reserved - used, count)
    else
      return
    end
    save(key, start + len - now, start, count)
  end

  return check, commit, settle
end
