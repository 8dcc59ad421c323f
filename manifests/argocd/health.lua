-- Argo CD health of a GpuSlice or GpuPackage (gpuslice.io/v1beta1), read the way kstatus reads it:
--   status missing or behind metadata.generation -> Progressing (the operator has not seen it yet)
--   Stalled=True, or phase Failed                 -> Degraded    (someone must act; message says what)
--   Ready=True for this generation                -> Healthy
--   Reconciling=True, or anything else             -> Progressing (it gets there by itself)
-- A package whose deletion is held by slices that still use it is Progressing with that message.
local hs = {}
local function current(cond)
  return cond.observedGeneration == nil or obj.metadata.generation == nil
    or cond.observedGeneration == obj.metadata.generation
end
if obj.status == nil then
  hs.status = "Progressing"
  hs.message = "waiting for the gpuslice operator to write status"
  return hs
end
if obj.metadata.generation ~= nil and obj.status.observedGeneration ~= nil
    and obj.status.observedGeneration < obj.metadata.generation then
  hs.status = "Progressing"
  hs.message = "waiting for the gpuslice operator to see generation " .. obj.metadata.generation
  return hs
end
local byType = {}
if obj.status.conditions ~= nil then
  for _, cond in ipairs(obj.status.conditions) do
    byType[cond.type] = cond
  end
end
local function says(cond, fallback)
  if cond ~= nil and cond.message ~= nil and cond.message ~= "" then
    return cond.message
  end
  return fallback
end
if (byType["Stalled"] ~= nil and byType["Stalled"].status == "True") or obj.status.phase == "Failed" then
  hs.status = "Degraded"
  hs.message = says(byType["Stalled"], obj.status.message or "failed")
  return hs
end
if byType["Deleting"] ~= nil and byType["Deleting"].status == "True" then
  hs.status = "Progressing"
  hs.message = says(byType["Deleting"], "deletion is held")
  return hs
end
local ready = byType["Ready"]
if ready ~= nil and ready.status == "True" and current(ready) then
  hs.status = "Healthy"
  hs.message = says(ready, "Ready")
  return hs
end
hs.status = "Progressing"
hs.message = says(byType["Reconciling"], says(ready, obj.status.message or "reconciling"))
return hs
