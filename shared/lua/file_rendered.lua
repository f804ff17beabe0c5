-- Replace a produced file's unrendered outcomes with its rendered content, once (the API renders
-- a batch's output and error files on first read; two readers may race, and either's bytes are
-- the same). Nothing is written to a file deleted meanwhile: the hash is not brought back.
-- Slots: shared/scripts.py, FILE_RENDERED and file_rendered(): meta is JSON, with the rendered size.
-- Returns 1 when stored, 0 when the file is gone or was rendered already.
local file = KEYS[1]
local meta, content = unpack(ARGV, 1, 2)
if redis.call('HEXISTS', file, 'outcomes') == 0 then return 0 end
redis.call('HSET', file, 'meta', meta, 'content', content)
redis.call('HDEL', file, 'outcomes')
return 1
