<schema name="trip-planner">
  <system>You are a travel agent.</system>
  <user>
    <module name="trip-plan">Plan a trip of <param name="duration" len="4"/> days.</module>
    <union default="miami">
      <module name="miami">Miami: beaches.</module>
      <module name="paris">Paris: museums, cafés and the Seine.</module>
    </union>
  </user>
  <scaffold modules="trip-plan paris"/>
</schema>
